"""The stages of a build: export, quantize, build, validate, triton.

Each module declares its name, what it needs and its ``run``; the runner (:mod:`pipeline.run.runner`)
orders them and hashes each one's own import closure into its cache key.

May import: model kinds, toolkits and the ground floor; never the run, serve, plan, remote or the CLI.
"""
