"""The run: stages in order, their cache keys, the manifest and report.

* :mod:`.runner`: runs a recipe's stages, with stage caching and the run lock.
* :mod:`.report`: the manifest, ``report.md`` and the stage records.
* :mod:`.smoke`: the fast smoke build (``build --test``).
* :mod:`.preflight`: everything a command checks before its first stage.

May import: everything below it (stages, model kinds, toolkits, ground); never serve, plan, remote or the CLI.
"""
