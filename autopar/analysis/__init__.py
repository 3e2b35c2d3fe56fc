"""Analysis: the cost model (memory, bytes, FLOPs, time) and the pipeline-schedule simulator."""
