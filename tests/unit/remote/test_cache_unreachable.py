"""The shared stage cache against an endpoint that never answers: short limits,
few attempts, and off for the rest of the run after the first timeout or refused connection.

The endpoint is a listening socket on 127.0.0.1 whose connections are accepted (drained from
its queue) and never answered: every request times out reading. The test counts connections,
never seconds."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from conftest import ROOT
from pipeline.context import Progress, StageContext
from pipeline.recipe.load import load_recipe
from pipeline.remote import cache as remote_cache
from pipeline.remote.cache import RemoteCache
from pipeline.remote.s3 import S3Location


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Test credentials (no lookup of an instance role), no shared config, no proxy."""
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "none"),
                       "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                       "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}.items():
        monkeypatch.setenv(key, value)


class HungEndpoint:
    """A socket listening on 127.0.0.1 that takes connections and never writes a byte."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.held: list[socket.socket] = []

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def connections(self) -> int:
        """Connections made so far (each accepted and held open, unanswered)."""
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except BlockingIOError:
                return len(self.held)

    def close(self) -> None:
        for s in [*self.held, self.sock]:
            s.close()


@pytest.fixture
def hung():
    endpoint = HungEndpoint()
    yield endpoint
    endpoint.close()


def context(tmp_path: Path, stage: str) -> StageContext:
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"work_dir": str(tmp_path / "artifacts")})
    run_dir = tmp_path / "artifacts" / recipe.name
    (run_dir / stage).mkdir(parents=True, exist_ok=True)
    (run_dir / stage / "model.onnx").write_bytes(b"a stage output")
    return StageContext(recipe, tmp_path / "r.yaml", run_dir, stage, Progress())


def test_the_cache_client_has_short_limits_and_few_attempts():
    """Before: botocore's 60 s connect and read timeouts and 6 attempts per call (publish's client)."""
    config = RemoteCache(S3Location.parse("s3://127.0.0.1:9/models/ci")).client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (remote_cache.CONNECT_TIMEOUT_S, remote_cache.READ_TIMEOUT_S)
    assert config.retries["total_max_attempts"] == remote_cache.ATTEMPTS == 2
    assert remote_cache.CONNECT_TIMEOUT_S <= 5 and remote_cache.READ_TIMEOUT_S <= 15


def test_a_hung_endpoint_is_tried_once_per_attempt_then_the_cache_is_off_for_the_run(aws_env, hung, tmp_path, capsys):
    remote = RemoteCache(S3Location.parse(f"s3://127.0.0.1:{hung.port}/models/ci"),
                         connect_timeout_s=2, read_timeout_s=0.2, attempts=2)
    export = context(tmp_path, "export")
    assert remote.pull(export, "1" * 64) is None  # a miss: the stage runs here
    assert hung.connections() == 2  # the first call's 2 attempts, each a new connection that timed out
    err = capsys.readouterr().err
    assert err.count("off for the rest of this run") == 1 and "ReadTimeoutError" in err
    assert remote.off is not None and remote.off.startswith("export: ReadTimeoutError")
    # the stages after it: no call at all, no further console line
    assert remote.push(export, "1" * 64, {"artifact": {}, "record": {"status": "ok"}}) == "off"
    for stage in ("quantize", "build", "validate", "triton"):
        ctx = context(tmp_path, stage)
        assert remote.pull(ctx, "2" * 64) is None
        assert remote.push(ctx, "2" * 64, {"artifact": {}, "record": {"status": "ok"}}) == "off"
    assert hung.connections() == 2
    assert capsys.readouterr().err == ""
    summary = remote.summary()
    assert summary["off"] == remote.off and summary["pulled"] == summary["pushed"] == []
    assert len(summary["warnings"]) == 1 and "the remote cache is off for the rest of this run" in summary["warnings"][0]


def test_a_refused_connection_switches_the_cache_off_too(aws_env, tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connections are refused
    remote = RemoteCache(S3Location.parse(f"s3://127.0.0.1:{port}/models/ci"), connect_timeout_s=2, read_timeout_s=0.2)
    ctx = context(tmp_path, "export")
    assert remote.push(ctx, "1" * 64, {"artifact": {"status": "ok"}, "record": {"status": "ok"}}) == "off"
    assert remote.off is not None and "EndpointConnectionError" in remote.off
    assert remote.pull(context(tmp_path, "quantize"), "2" * 64) is None and len(remote.warnings) == 1
