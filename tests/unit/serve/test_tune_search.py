"""The serving search over a fake load with deterministic numbers: it finds the known best config,
respects the SLO, stops early, keeps within the time limit, skips refused / erroring candidates,
decides ties by resources, and reports an unmeetable SLO as infeasible."""
from __future__ import annotations

import pytest

from pipeline.serve import tune as T

CORES = 2
DEFAULT = T.Candidate.of({"compute": {"instance_count": 1, "max_batch_size": 8, "max_queue_delay_microseconds": 100,
                                      "preferred_batch_size": None, "intra_op_threads": 0}})
DIMS = (T.Dimension("compute", "instance_count", (1, 2)),
        T.Dimension("compute", "max_queue_delay_microseconds", T.QUEUE_DELAYS),
        T.Dimension("compute", "max_batch_size", (8, 16, 32)),
        T.Dimension("compute", "intra_op_threads", (0, 1, 2)))


def valid(c: T.Candidate) -> str | None:
    f = c.as_dict()["compute"]
    t = f["intra_op_threads"]
    return "over the cores" if t and f["instance_count"] * t > CORES else None


class FakeLoad:
    """Goodput and p99 as a fixed function of the config; each call advances a fake clock by 10 s."""

    def __init__(self, p99_of=None, refuse=(), error=()):
        self.now, self.calls = 0.0, []
        self.p99_of, self.refuse, self.error = p99_of, refuse, error

    def clock(self) -> float:
        return self.now

    def goodput(self, f: dict) -> float:
        g = 5.0 + 1.5 * (f["instance_count"] == 2) + (f["max_queue_delay_microseconds"] == 1000) \
            + 0.5 * (f["max_batch_size"] == 16) - 0.5 * (f["intra_op_threads"] == 2)
        return g

    def __call__(self, cand: T.Candidate) -> T.Measurement:
        self.now += 10.0
        self.calls.append(cand)
        f = cand.as_dict()["compute"]
        if any(all(f.get(k) == v for k, v in r.items()) for r in self.refuse):
            return T.Measurement(T.REFUSED, detail="E1206 model 'm': failed to load")
        if any(all(f.get(k) == v for k, v in r.items()) for r in self.error):
            return T.Measurement(T.ERRORS, detail="ServeClientError")
        g = self.goodput(f)
        p99 = self.p99_of(f) if self.p99_of else 100.0 / g
        slo = 50.0
        return T.Measurement(T.OK, goodput_rps=g if p99 <= slo else 0.0, throughput_rps=g, p50_ms=p99 / 2, p99_ms=p99,
                             requests=16, duration_s=10.0, feasible=p99 <= slo, over_slo="" if p99 <= slo else "p99")


def run(load: FakeLoad, time_limit_s: float = 10_000, repeats: int = 2) -> T.Outcome:
    return T.search(DEFAULT, DIMS, load, time_limit_s=time_limit_s, repeats=repeats, cores=CORES, valid=valid,
                    clock=load.clock, log=lambda s: None)


def test_search_picks_the_known_best_config():
    load = FakeLoad()
    out = run(load)
    assert out.feasible
    assert out.chosen.as_dict()["compute"] == {"instance_count": 2, "max_batch_size": 16,
                                               "max_queue_delay_microseconds": 1000, "preferred_batch_size": None,
                                               "intra_op_threads": 0}
    assert out.stopped == "a pass over every dimension improved nothing"
    # early stopping: far fewer measurements than the grid (2 x 5 x 3 x 3 = 90), each config searched once
    searched = [r["candidate"] for r in out.rows if r["phase"] != "repeat"]
    assert len(searched) == len(set(searched)) < 30
    # 2 instances x 2 threads is over the cores: never run
    assert not any(c.get("compute", "instance_count") * c.get("compute", "intra_op_threads") > CORES for c in load.calls)
    # the best two and the default were repeated, interleaved
    repeats = [r["candidate"] for r in out.rows if r["phase"] == "repeat"]
    assert len(repeats) == 6 and repeats[:3] == repeats[3:] and DEFAULT in repeats
    assert T.ratio_to_default(out)["ratio"] == pytest.approx(8.0 / 5.0)  # 5 + 1.5 (2 instances) + 1 (1000 us) + 0.5 (mbs 16)


def test_search_respects_the_slo():
    # two instances are fastest but their p99 is over the SLO: the best feasible config is chosen
    load = FakeLoad(p99_of=lambda f: 80.0 if f["instance_count"] == 2 else 10.0)
    out = run(load)
    chosen = out.chosen.as_dict()["compute"]
    assert out.feasible and chosen["instance_count"] == 1
    assert chosen["max_queue_delay_microseconds"] == 1000 and chosen["max_batch_size"] == 16


def test_unmeetable_slo_is_infeasible_and_names_the_best():
    out = run(FakeLoad(p99_of=lambda f: 500.0 / FakeLoad().goodput(f)))  # every p99 >= 58 ms > 50 ms
    assert not out.feasible
    best, m = out.best_infeasible()
    assert m.p99_ms == min(r["measurement"].p99_ms for r in out.rows)


def test_refused_and_erroring_candidates_are_skipped_not_measured():
    load = FakeLoad(refuse=[{"instance_count": 2}], error=[{"max_queue_delay_microseconds": 1000}])
    out = run(load)
    statuses = {r["candidate"]: r["measurement"].status for r in out.rows}
    assert T.REFUSED in statuses.values() and T.ERRORS in statuses.values()
    chosen = out.chosen.as_dict()["compute"]
    assert chosen["instance_count"] == 1 and chosen["max_queue_delay_microseconds"] != 1000
    assert all(r["measurement"].status == T.OK for r in out.rows if r["candidate"] == out.chosen)


def test_time_limit_leaves_room_for_the_repeats():
    load = FakeLoad()
    out = run(load, time_limit_s=100.0, repeats=2)
    assert "time limit" in out.stopped
    assert load.now <= 100.0  # 10 s per measurement: the search stops while the repeats still fit
    assert any(r["phase"] == "repeat" for r in out.rows)


def test_a_tie_within_the_spread_goes_to_fewer_resources():
    a = T.Candidate.of({"compute": {"instance_count": 2, "intra_op_threads": 1}})
    b = T.Candidate.of({"compute": {"instance_count": 1, "intra_op_threads": 1}})
    out = T.Outcome(b)
    for cand, goodputs in ((a, (10.0, 9.0, 11.5)), (b, (10.2, 9.5, 10.4))):
        for g in goodputs:
            out.rows.append({"candidate": cand, "phase": "repeat",
                             "measurement": T.Measurement(T.OK, goodput_rps=g, p99_ms=1.0, feasible=True)})
    decision = T.decide(out, [a, b], CORES)
    assert decision["chosen"] == b and decision["how"].startswith("tie")
    for r in out.rows:
        if r["candidate"] == a:
            r["measurement"].goodput_rps += 10.0  # medians 20.0 vs 10.2, spreads 2.5 and 0.9
    assert T.decide(out, [a, b], CORES)["chosen"] == a


def test_unmeetable_slo_exits_1_and_pins_nothing(tmp_path, capsys):
    from types import SimpleNamespace as NS

    from pipeline.recipe.schema import ServeConfig

    recipe = NS(name="r", serve=ServeConfig(concurrency=[4], slo={"latency_ms": 1.0}))
    served = NS(recipe=recipe, run_dir=tmp_path / "run", target="python-onnxruntime")
    out = run(FakeLoad(p99_of=lambda f: 500.0))  # every p99 500 ms over the fake's 50 ms SLO
    sp = T.Space(DEFAULT, DIMS, CORES, 32, {"compute": "m"})
    assert T.finish(out, sp, {}, served, tmp_path / "r.yaml") == 1
    err = capsys.readouterr().err
    assert "no candidate met serve.slo at concurrency 4: the best candidate, compute: " in err
    assert "had p99 500 ms; nothing pinned" in err
    assert not (tmp_path / "tuned").exists()
    assert "No candidate met the SLO" in (tmp_path / "run" / "tune_serving" / "tune.md").read_text()


@pytest.mark.parametrize("tune, message", [
    ({"concurrency": 0}, "greater than or equal to 1"),
    ({"time_limit_s": 5, "measure_s": 10}, "below one measurement"),
])
def test_impossible_tune_values_are_refused_at_check(tune, message):
    from pydantic import ValidationError

    from pipeline.recipe.schema import ServeConfig

    with pytest.raises(ValidationError, match=message):
        ServeConfig(tune=tune)


def test_ctrl_c_keeps_the_partial_table_and_pins_nothing(tmp_path):
    from types import SimpleNamespace as NS

    from pipeline.recipe.schema import ServeConfig

    load = FakeLoad()

    def measure(cand):
        if len(load.calls) == 3:
            raise KeyboardInterrupt
        return load(cand)

    out = T.Outcome(DEFAULT)
    with pytest.raises(KeyboardInterrupt):
        T.search(DEFAULT, DIMS, measure, time_limit_s=1e4, repeats=2, cores=CORES, valid=valid, clock=load.clock,
                 log=lambda s: None, outcome=out)
    assert len(out.rows) == 3 and out.chosen is None  # what was measured before Ctrl-C, no choice
    out.interrupted = True
    served = NS(recipe=NS(name="r", serve=ServeConfig(concurrency=[4])), run_dir=tmp_path, target="python-onnxruntime")
    result = T.report(out, T.Space(DEFAULT, DIMS, CORES, 32, {"compute": "m"}), {}, served, tmp_path / "tune")
    assert result["interrupted"] and len(result["candidates"]) == 3
    assert "Interrupted (Ctrl-C): this is the partial table; nothing was pinned." in result["markdown"]


def test_open_loop_sends_every_request_on_its_own_connections_and_closes_them():
    from pipeline.serve.bench import open_loop

    closed = []

    class Conn:
        def close(self):
            closed.append(self)

    results, duration, late = open_loop(500.0, 12, Conn, lambda conn, i: (type(conn).__name__, i), max_in_flight=3)
    assert results == [("Conn", i) for i in range(12)] and duration > 0 and late >= 0
    assert 1 <= len(closed) <= 3  # one connection per sending thread, each closed


def test_rate_and_concurrency_are_one_operating_point():
    from pydantic import ValidationError

    from pipeline.recipe.schema import ServeConfig

    with pytest.raises(ValidationError, match="give one operating point"):
        ServeConfig(tune={"rate": 5.0, "concurrency": 4})
    assert str(T.operating_point(_recipe(rate=5.0))) == "5 requests/s (open loop)"
    assert str(T.operating_point(_recipe())) == "concurrency 16"  # the largest of serve.concurrency


def _recipe(**tune):
    from types import SimpleNamespace as NS

    from pipeline.recipe.schema import ServeConfig

    return NS(serve=ServeConfig(tune=tune))
