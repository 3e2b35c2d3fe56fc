"""The process that the gloo pools' workers (and the fault cases' ranks) are forked from.

``autopar.testing.process_context()`` names this module as the preload of multiprocessing's
fork server: the server imports it once, and every worker process is then a fork of the server,
with torch, dynamo, AOTAutograd, DTensor, autopar and transformers already imported. A spawned
worker imports them itself: about 2.7 s of CPU per process on this machine, and a test session
starts about 30 of them. Forked, a 2-rank pool's first job ran in 2.4 s instead of 5.1 s
(``tests/test_pools.py`` checks that the workers are forks of this server).

Importing this module has process-wide effects (one intra-op thread; the import's objects frozen
out of the cyclic garbage collector's reach, as ``autopar.testing._freeze_imports`` does in each
worker): it is meant to be imported by the fork server only, and nothing else imports it.
"""

import atexit
import contextlib
import gc

import torch

torch.set_num_threads(1)  # (the workers run one intra-op thread each; no OpenMP pool exists to fork)

import autopar.compiler  # noqa: E402,F401
import autopar.passes  # noqa: E402,F401
import autopar.runtime.module  # noqa: E402,F401
import autopar.runtime.pipeline  # noqa: E402,F401
import autopar.testing  # noqa: E402,F401
import autopar.torch_compat  # noqa: E402

autopar.torch_compat.preload()  # dynamo and AOTAutograd
import torch.distributed  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
with contextlib.suppress(ImportError):  # (an optional dependency: the tests' Hugging Face models)
    import transformers  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

SERVER = True  # (the test reads it in a worker: the module is there without the worker importing it)

autopar.testing._freeze_imports()  # (the workers call it again after making their process group)
# frozen objects are never freed: unfrozen when the server exits, or nanobind reports Triton's
# objects as leaked (the forked workers end by os._exit and skip this)
atexit.register(gc.unfreeze)
