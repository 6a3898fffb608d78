"""``pipeline plan``: GPU capacity of a built causal-LM recipe (:mod:`.capacity`), the published GPU
figures it sizes for (:mod:`.gpus`) and the measurements it checks its formulas against (:mod:`.measure`)."""
