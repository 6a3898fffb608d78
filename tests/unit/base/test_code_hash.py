"""A stage's code hash covers the Python files it copies into model repositories, which nothing imports."""
from pathlib import Path

from pipeline import imports, provenance

PACKAGE = Path(provenance.__file__).resolve().parent


def test_every_python_file_the_cli_does_not_import_is_shipped():
    """A ``.py`` under pipeline/ outside the CLI's import closure is code copied into repositories (a
    Triton python model) or a stand-alone tool: code copied must sit under a ``provenance.SHIPPED``
    folder, or editing it would re-run no stage."""
    modules = imports.package_modules()
    reached = {Path(modules[m]).resolve() for m in imports.closure("pipeline.cli.app") if m in modules}
    shipped = [PACKAGE / folder for _, folder in provenance.SHIPPED]
    tools = {"__main__.py", "docs_reference.py"}  # entry points: python -m pipeline / pipeline.docs_reference
    loose = [str(f.relative_to(PACKAGE)) for f in sorted(PACKAGE.rglob("*.py"))
             if f.resolve() not in reached and f.name not in tools and f.name != "__init__.py" and not any(f.is_relative_to(s) for s in shipped)]
    assert len(reached) > 100
    assert loose == [], f"{loose}: neither imported by the CLI nor under provenance.SHIPPED"


def test_editing_the_image_preprocessing_model_changes_the_triton_stage_hash(monkeypatch):
    """``preprocess_model.py`` is copied into image-classification repositories, never imported."""
    target = PACKAGE / "models" / "image_classification" / "preprocess_model.py"
    provenance.code_hash.cache_clear()
    before = provenance.code_hash("pipeline.stages.triton")
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + (b"\n# edited\n" if p == target else b""))
    provenance.code_hash.cache_clear()
    try:
        assert provenance.code_hash("pipeline.stages.triton") != before
    finally:
        provenance.code_hash.cache_clear()
