"""Serve a recipe's generated Triton repository on a real tritonserver, and measure it.

* :mod:`.prepare`: what to serve (the published repository, or a
  python-onnxruntime copy when the local server lacks the target's backend)
  and the bench variants of the compute model.
* :mod:`.client`: tritonclient calls (gRPC streaming generation, inference,
  statistics).
* :mod:`.check`: the served greedy tokens against the validate stage's.
* :mod:`.stats`: percentiles, TTFT / TPOT / goodput, Triton batch statistics.
* :mod:`.bench`: the load sweeps; :mod:`.report`: the markdown tables.
* :mod:`.run`: ``serve`` (foreground) and ``bench`` entry points shared by the CLI.
"""
