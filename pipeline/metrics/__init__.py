"""Model-quality and speed statistics shared by the model kinds.

* :mod:`.llm_quality`: streaming perplexity-ratio / KL-divergence / top-1 / delta-p
  statistics of a causal LM against its FP32 reference (llama.cpp's
  ``llama-perplexity --kl-divergence``).
* :mod:`.speed`: ONNX Runtime timing of the reference and the candidate graph
  (``speedup_vs_fp32``).
"""
