"""Our load generator against AIPerf's: throughput at one operating point, same server, same model.

``tune-serving --cross-check aiperf`` (on the chosen config, after the search) and
``benchmarks/aiperf_crosscheck.py`` (on the served config) alternate the two clients on one running
tritonserver, ours first and last::

    ours_0, AIPerf_1, ours_1, AIPerf_2, ours_2, ..., AIPerf_n, ours_n

Ours is :meth:`pipeline.serve.tune.Runner.drive` (bench's closed loop at ``serve.tune.concurrency``,
the search's own measurement) on AIPerf's route, so the server does the same work for both clients
(the search itself stays on gRPC). AIPerf sends as many requests as the ours run before it did, at
the same concurrency, after the same number of warm-up requests:

* generation (fp8-llm): streamed ``/v1/completions`` through the project's OpenAI-compatible endpoint.
  AIPerf: :func:`pipeline.serve.bench.aiperf_llm_command` (synthetic prompts of the validate prompt's
  length, ``serve.max_tokens`` tokens with EOS ignored); ours: :class:`pipeline.serve.client.CompletionsHTTP`
  with AIPerf's request body (:func:`pipeline.serve.client.completions_body`) and the validate
  prompts as text (:func:`pipeline.serve.bench.llm_prompt_texts`), TTFT at the first content chunk;
* encoders (int8-encoder): KServe v2 JSON on Triton's HTTP route ``/v2/models/<ensemble>/infer``,
  the sentences of bench's workload in bench's order. AIPerf: its ``template`` endpoint with a Jinja2
  request body (:func:`kserve_template`, ``--dataset-sampling-strategy sequential``); ours:
  :class:`pipeline.serve.client.KServeHTTP` with the same body (:func:`pipeline.serve.client.kserve_json_body`).

After the first AIPerf run its request bodies (its ``inputs.json``) are compared with ours
(:func:`body_differences`; for the LLM the prompt aside, whose token counts are given instead).

Both clients run at :data:`CLIENT_NICE` (``client_nice``): AIPerf under ``nice -n``, our load threads
each raising their own nice value by as much (:func:`pipeline.serve.bench.lower_thread_priority`), so
on a CPU-bound server with few cores neither client's CPU comes out of the server's share first.

Round i's ratio is AIPerf_i's requests/s over the mean of the ours runs either side of it (which
cancels a linear drift of the shared machine's load). Reported: the mean ratio with its standard
error over rounds, the min and max, and whether the mean is within :data:`TOLERANCE` of 1 (issue
39's bound). A run with any request error, ours or AIPerf's (:func:`pipeline.serve.bench.aiperf_errors`),
is not a measurement: the cross-check stops there with ``failed`` and its callers exit 4, as bench does.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Log = Callable[[str], None]

#: |AIPerf / ours - 1| allowed for the two clients to "agree" (issue 39: within 10 %).
TOLERANCE = 0.10
#: How much both clients lower their CPU priority (nice value, added to this process's).
CLIENT_NICE = 10


def aiperf_throughput(export: dict) -> float:
    """Requests/s of an AIPerf ``profile_export_aiperf.json`` (``request_throughput.avg``: its
    request count over the time from the first request sent to the last response).

    Raises:
        ValueError: the export has no ``request_throughput`` (not a finished profile run).
    """
    value = (export.get("request_throughput") or {}).get("avg")
    if value is None:
        raise ValueError("the AIPerf export has no request_throughput.avg")
    return float(value)


def crosscheck_ratio(ours: list[float], theirs: list[float], tolerance: float = TOLERANCE) -> dict:
    """The ratio AIPerf / ours of interleaved throughputs (requests/s).

    Args:
        ours: our client's runs, ``len(theirs) + 1`` of them, ours_0 before AIPerf_1 and ours_i after
            AIPerf_i.
        theirs: AIPerf's runs, at least one.
        tolerance: the agreement bound on |mean ratio - 1|.

    Returns:
        ``per_round`` (AIPerf_i / mean(ours_{i-1}, ours_i)), ``mean``, ``stderr`` (sample standard
        deviation / sqrt(rounds); None for one round), ``min``, ``max``, ``rounds``, the medians of
        each client's throughput, ``within_tolerance`` (|mean - 1| <= tolerance) and ``within_noise``
        (:func:`within_noise`: that verdict is less than 2 standard errors from flipping).

    Raises:
        ValueError: the counts do not interleave, or a throughput is not positive.
    """
    if not theirs or len(ours) != len(theirs) + 1:
        raise ValueError(f"interleaved runs need one more of ours than AIPerf's; got {len(ours)} and {len(theirs)}")
    if any(not (x > 0) for x in [*ours, *theirs]):
        raise ValueError(f"every throughput must be > 0; got ours {ours}, AIPerf {theirs}")
    per_round = [t / ((ours[i] + ours[i + 1]) / 2) for i, t in enumerate(theirs)]
    n = len(per_round)
    mean = float(np.mean(per_round))
    stderr = float(np.std(per_round, ddof=1) / math.sqrt(n)) if n > 1 else None
    return {"per_round": per_round, "mean": mean, "stderr": stderr, "min": min(per_round), "max": max(per_round),
            "rounds": n, "ours_median_rps": float(np.median(ours)), "aiperf_median_rps": float(np.median(theirs)),
            "tolerance": tolerance, "within_tolerance": abs(mean - 1) <= tolerance,
            "within_noise": within_noise(mean, stderr, tolerance)}


def within_noise(mean: float, stderr: float | None, tolerance: float = TOLERANCE) -> bool:
    """Whether the verdict on ``|mean - 1| <= tolerance`` could flip within 2 standard errors of the
    mean (the same 2-SE margin the accuracy gates report as "within noise"); with one round (no
    standard error) a verdict is always within noise."""
    if stderr is None:
        return True
    return abs(abs(mean - 1) - tolerance) < 2 * stderr


def interleave(rounds: int, ours: Callable[[], dict], theirs: Callable[[int, dict], dict], log: Log = print, *,
               settle: bool = True) -> dict:
    """Run ``ours, theirs, ours, ..., theirs, ours`` (``rounds`` of theirs) and compute the ratio.
    With ``settle``, one more ours run goes first and is not counted (``settle``): the first loaded
    run after a (re)load was the slowest on the served LLM (0.70 requests/s, the next ones 1.2-1.5).

    Args:
        ours: one run of our client: ``{"throughput_rps", "requests", ...}`` or ``{"failed": why}``.
        theirs: one AIPerf run sending ``requests`` (the previous ours run's count), given that run:
            ``{"throughput_rps", ...}`` or ``{"failed": why}``.

    Returns:
        ``{"ours": [...], "aiperf": [...], "ratio": crosscheck_ratio(...)}``; on the first failed run
        ``{"failed": why, "ours", "aiperf"}`` with the runs before it (no ratio: a run with errors is
        not a measurement).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    runs: dict[str, list[dict]] = {"ours": [], "aiperf": []}

    def step(name: str, run: Callable[[], dict]) -> str | None:
        r = run()
        if "failed" in r:
            log(f"cross-check: {name} run {len(runs[name]) + 1}: failed: {r['failed']}")
            return f"{name} run {len(runs[name]) + 1}: {r['failed']}"
        runs[name].append(r)
        log(f"cross-check: {name} run {len(runs[name])}: {r['throughput_rps']:.4g} requests/s "
            f"({r.get('requests')} requests)")
        return None

    first: dict = {}
    if settle:
        first = ours()
        if "failed" in first:
            return {"failed": f"settling run: {first['failed']}", **runs}
        log(f"cross-check: settling run (not counted): {first['throughput_rps']:.4g} requests/s")
    if why := step("ours", ours):
        return {"failed": why, **runs, **({"settle": first} if first else {})}
    for _ in range(rounds):
        before = runs["ours"][-1]
        if (why := step("aiperf", lambda: theirs(int(before["requests"]), before))) or (why := step("ours", ours)):
            return {"failed": why, **runs, **({"settle": first} if first else {})}
    ratio = crosscheck_ratio([r["throughput_rps"] for r in runs["ours"]], [r["throughput_rps"] for r in runs["aiperf"]])
    return {**runs, **({"settle": first} if first else {}), "ratio": ratio}


# ---------------------------------------------------------------- the encoder's request body

def kserve_template(input_name: str) -> str:
    """AIPerf's ``payload_template`` (Jinja2, rendered with autoescape) for one sentence to a Triton
    model whose input ``input_name`` is BYTES ``[batch, 1]``: the KServe v2 inference request
    ``{"inputs": [{"name", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}``
    (https://kserve.github.io/website/docs/concepts/architecture/data-plane/v2-protocol); ``tojson``
    quotes the text as JSON."""
    return ('{"inputs": [{"name": ' + json.dumps(input_name) + ', "shape": [1, 1], "datatype": "BYTES", '
            '"data": [{{ text|tojson }}]}]}')


def encoder_dataset(requests: list[dict[str, np.ndarray]]) -> tuple[str, list[str]]:
    """The text input's name and the sentences of bench's encoder workload (its requests: one BYTES
    ``[1, 1]`` array each), in order.

    Raises:
        ValueError: a request has another input than one BYTES ``[1, 1]`` tensor (naming them): the
            template cross-check sends one sentence per request.
    """
    names = {tuple(sorted(r)) for r in requests}
    if len(names) != 1 or len(next(iter(names))) != 1:
        raise ValueError(f"the encoder workload's requests have inputs {sorted(names)}; the AIPerf template "
                         "cross-check sends one text input")
    (name,) = next(iter(names))
    texts = []
    for r in requests:
        a = r[name]
        if a.dtype != np.object_ or a.shape != (1, 1):
            raise ValueError(f"input {name!r} is {a.dtype} {list(a.shape)}; the template cross-check sends BYTES [1, 1]")
        v = a[0, 0]
        texts.append(v.decode() if isinstance(v, bytes) else str(v))
    return name, texts


def aiperf_encoder_command(exe: str, *, http_url: str, model: str, input_name: str, texts: list[str],
                           tokenizer: str, concurrency: int, requests: int, warmup: int, folder: Path) -> list[str]:
    """AIPerf's command for one sentence per request to ``model`` on Triton's HTTP ``/v2/models/<model>/infer``
    (template endpoint; ``response_field`` ``outputs[0].data``: the first output's values, read as an
    embedding). Writes the template and the sentences (``single_turn`` JSONL, sent in order, cycled)
    into ``folder``'s parent. ``tokenizer``: a folder AIPerf loads offline to count input tokens."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    template = folder.parent / "kserve_infer.j2"
    template.write_text(kserve_template(input_name))
    data = folder.parent / "sentences.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return [exe, "profile", "--model", model, "--url", f"http://{http_url}", "--endpoint-type", "template",
            "--endpoint", f"/v2/models/{model}/infer",
            "--extra-inputs", json.dumps({"payload_template": str(template), "response_field": "outputs[0].data"}),
            "--input-file", str(data), "--custom-dataset-type", "single_turn",
            "--dataset-sampling-strategy", "sequential", "--tokenizer", tokenizer,
            "--concurrency", str(concurrency), "--request-count", str(requests),
            *(["--warmup-request-count", str(warmup)] if warmup else []),
            "--random-seed", "0", "--ui-type", "none", "--output-artifact-dir", str(folder)]


# ---------------------------------------------------------------- the requests AIPerf sent

def aiperf_payloads(folder: Path) -> list[dict]:
    """The request bodies of one AIPerf run (its ``inputs.json`` under ``folder``: one entry per
    dataset session, its first turn's payload); empty when there is none."""
    found = next(iter(sorted(folder.rglob("inputs.json"))), None)
    if found is None:
        return []
    return [d["payloads"][0] for d in json.loads(found.read_text()).get("data", []) if d.get("payloads")]


def body_differences(aiperf: list[dict], ours: list[dict], *, ignore: tuple[str, ...] = ()) -> list[str]:
    """Where AIPerf's request bodies differ from ours: ``aiperf[i]`` against ``ours[i % len(ours)]``,
    top-level fields in ``ignore`` left out; one line per differing body (the first 3), empty: the same."""
    out = []
    for i, theirs in enumerate(aiperf):
        mine = ours[i % len(ours)]
        a = {k: v for k, v in theirs.items() if k not in ignore}
        b = {k: v for k, v in mine.items() if k not in ignore}
        if a != b:
            out.append(f"request {i}: AIPerf {json.dumps(a)[:200]}, ours {json.dumps(b)[:200]}")
    return out[:3]


def _span(values: list[int]) -> list[int] | None:
    return [min(values), max(values)] if values else None


# ---------------------------------------------------------------- on a running server

def cross_check(served, server, runner, *, rounds: int, folder: Path, log: Log = print,
                timeout_s: float = 900.0, nice: int = CLIENT_NICE) -> dict:
    """:func:`interleave` our client (``runner.drive(<AIPerf's route>, nice=nice)``, what the server
    has loaded now) and AIPerf (under ``nice -n <nice>``) on ``server`` at ``runner.point`` (a
    concurrency), ``rounds`` AIPerf runs, their files in ``folder``. A generating recipe is driven
    through the OpenAI endpoint, started here (in this process, on a free port) and stopped.
    Each run's ``client_cpu`` in cores: ours, the load threads' own CPU time over the run (warm-up
    included; ``process_cores``: this whole process's, ``RUSAGE_SELF``, which for the LLM includes
    the OpenAI endpoint's thread: server work); AIPerf's, its process tree's
    (:func:`pipeline.serve.bench.client_cpu`; warm-up, start-up and shutdown included).

    Returns :func:`interleave`'s dict plus ``tool``, ``route`` and ``ours_route`` (now the same),
    ``client_nice``, ``point``, ``command`` (the last AIPerf command), ``requests_compared`` (after
    the first AIPerf run: ``bodies``, ``differences`` (:func:`body_differences`) and, for the LLM,
    ``prompt_tokens`` ``{"ours", "aiperf"}`` [min, max] by the served tokenizer), ``loadavg_1m``
    (start, end); ``{"skipped": why}`` without the ``aiperf`` CLI, at an offered rate (open loop: both
    would report the rate), or for a workload that is not one text.

    Raises:
        TritonServerError: (exit 4) the server died.
    """
    import numpy as np

    from pipeline.serve import bench as B
    from pipeline.serve.client import completions_body, kserve_json_body
    from pipeline.serve.run import start_endpoint

    exe = B.aiperf_exe()
    if exe is None:
        return {"skipped": "the aiperf CLI is not installed (pip install aiperf)"}
    point = runner.point
    if point.concurrency is None:
        return {"skipped": f"the operating point is an offered rate ({point}): in an open loop both clients "
                           "send at that rate, so their throughputs cannot differ by the client"}
    c = int(point.concurrency)
    generates = bool(served.generate_model)
    if not generates:
        workload = served.adapter.bench_workload(served.recipe, served.artifacts["export"].tokenizer_dir)
        try:
            input_name, texts = encoder_dataset(workload.requests)
        except ValueError as e:
            return {"skipped": str(e)}
    state: dict[str, Any] = {"command": []}

    def ours() -> dict:
        import resource
        import time

        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        m = runner.drive(state["url"] if generates else server.http_url, nice=nice)
        wall = time.perf_counter() - start
        process = B.client_cpu(before, resource.getrusage(resource.RUSAGE_SELF), wall)
        if not m.ok:
            return {"failed": f"{m.status}: {m.detail}"}
        cpu = {"cpu_s": runner.client_cpu_s, "wall_s": wall, "cores": runner.client_cpu_s / wall if wall > 0 else None,
               "cpus": os.cpu_count(), "process_cores": process["cores"]}
        return {"throughput_rps": m.throughput_rps, "requests": m.requests, "duration_s": m.duration_s,
                "p50_ms": m.p50_ms, "p99_ms": m.p99_ms, "client_cpu": cpu}

    def theirs(requests: int, _before: dict) -> dict:
        run_folder = folder / f"aiperf_{len(list(folder.glob('aiperf_*'))) + 1}"
        if generates:
            cmd = B.aiperf_llm_command(exe, served, state["url"], c, requests, run_folder, warmup=point.warm_up)
        else:
            cmd = aiperf_encoder_command(exe, http_url=server.http_url, model=str(served.ensemble_model),
                                         input_name=input_name, texts=texts,
                                         tokenizer=str(Path(served.artifacts["export"].tokenizer_dir).resolve()),
                                         concurrency=c, requests=requests, warmup=2 * point.warm_up,
                                         folder=run_folder)
        state["command"] = cmd
        done = B.run_aiperf(cmd, run_folder, timeout_s, where=f"concurrency {c}", nice=nice)
        if "failed" in done:
            runner.check_alive()  # a dead server is exit 4 with its log, not an AIPerf failure
            return done
        if "requests_compared" not in state:
            state["requests_compared"] = compare(aiperf_payloads(run_folder))
        export = done["export"]
        try:
            rps = aiperf_throughput(export)
        except ValueError as e:
            return {"failed": str(e)}
        latency = export.get("time_to_first_token" if generates else "request_latency") or {}  # ours' p50/p99
        return {"throughput_rps": rps, "requests": int((export.get("request_count") or {}).get("avg") or 0),
                "duration_s": (export.get("benchmark_duration") or {}).get("avg"),
                "p50_ms": latency.get("p50"), "p99_ms": latency.get("p99"),
                "output_token_throughput": (export.get("output_token_throughput") or {}).get("avg"),
                "client_cpu": done["client_cpu"]}

    def compare(payloads: list[dict]) -> dict:
        if not generates:
            mine = [kserve_json_body({input_name: np.array([[t]], dtype=np.object_)}) for t in texts]
            return {"bodies": len(payloads), "differences": body_differences(payloads, mine)}
        from tokenizers import Tokenizer

        from pipeline.serve.openai.app import find_model_folder

        tok = Tokenizer.from_file(str(find_model_folder(served.repository, str(served.generate_model))
                                      / "tokenizer.json"))
        mine = [completions_body(str(served.generate_model), "", served.recipe.serve.max_tokens, ignore_eos=True)]
        theirs_tokens = [len(tok.encode(t).ids) for p in payloads for t in (p.get("prompt") or [])[:1]]
        return {"bodies": len(payloads), "differences": body_differences(payloads, mine, ignore=("prompt",)),
                "prompt_tokens": {"ours": _span(B.llm_prompt_texts(served)[1]), "aiperf": _span(theirs_tokens)}}

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("aiperf_*"):
        shutil.rmtree(old, ignore_errors=True)
    load_start = os.getloadavg()[0]
    route = ("streamed /v1/completions through the OpenAI endpoint" if generates
             else f"KServe v2 JSON, HTTP /v2/models/{served.ensemble_model}/infer")
    log(f"cross-check: our client vs AIPerf, both on {route}, both at nice +{nice}, at {point}, "
        f"{rounds} AIPerf runs, interleaved")
    if generates:
        with start_endpoint(served, server, port=0) as endpoint:
            state["url"] = endpoint.url
            result = interleave(rounds, ours, theirs, log)
    else:
        result = interleave(rounds, ours, theirs, log)
    return {"tool": f"aiperf {B._version('aiperf')}", "route": route, "ours_route": route, "client_nice": nice,
            "point": str(point), "concurrency": c, **result, "command": state["command"],
            **({"requests_compared": state["requests_compared"]} if "requests_compared" in state else {}),
            "loadavg_1m": [load_start, os.getloadavg()[0]]}


def render(result: dict) -> list[str]:
    """Markdown lines for a :func:`cross_check` result."""
    if "skipped" in result:
        return [f"Cross-check with AIPerf: not run: {result['skipped']}."]
    if result.get("ours_route") == result.get("route"):
        head = (f"Cross-check with {result.get('tool', 'AIPerf')} at {result.get('point')}: ours and AIPerf, both "
                f"on {result.get('route')}, interleaved")
    else:
        head = (f"Cross-check with {result.get('tool', 'AIPerf')} at {result.get('point')}: ours "
                f"({result.get('ours_route')}) and AIPerf ({result.get('route')}), interleaved")
    nice = result.get("client_nice")
    head += f"; both clients at nice +{nice}." if nice else "."
    compared = result.get("requests_compared")
    if compared:
        diff = compared.get("differences") or []
        head += (f" AIPerf's {compared.get('bodies')} request bodies "
                 + (f"differ from ours: {'; '.join(diff)}." if diff else "have our fields and values")
                 + (f" (the prompt aside; prompt tokens ours {compared['prompt_tokens'].get('ours')}, AIPerf "
                    f"{compared['prompt_tokens'].get('aiperf')})" if compared.get("prompt_tokens") else "")
                 + ("" if diff else "."))
    what = "TTFT " if result.get("route", "").startswith("streamed") else "latency "
    lines = [head, "", f"| run | client | requests | requests/s | {what}p50 ms | {what}p99 ms | client CPU (cores) |",
             "|---|---|---|---|---|---|---|"]
    ours, theirs = result.get("ours", []), result.get("aiperf", [])
    order = [("ours (settling, not counted)", result["settle"])] if result.get("settle") else []
    order += [("ours", ours[0])] if ours else []
    for i, t in enumerate(theirs):
        order.append(("AIPerf", t))
        if i + 1 < len(ours):
            order.append(("ours", ours[i + 1]))
    for k, (who, r) in enumerate(order, 1):
        cpu = (r.get("client_cpu") or {}).get("cores")
        lines.append(f"| {k} | {who} | {r.get('requests')} | {r['throughput_rps']:.4g} | {_num(r.get('p50_ms'))} | "
                     f"{_num(r.get('p99_ms'))} | {_num(cpu, '.2f')} |")
    lines.append("")
    if "failed" in result:
        lines.append(f"**Cross-check failed: {result['failed']}** (a run with request errors is not a measurement).")
        return lines
    r = result["ratio"]
    err = f" +- {r['stderr']:.3f}" if r["stderr"] is not None else ""
    lines.append(f"**AIPerf / ours requests/s: {r['mean']:.3f}{err} (mean +- standard error over {r['rounds']} "
                 f"rounds; per round {r['min']:.3f}-{r['max']:.3f}); "
                 f"{'within' if r['within_tolerance'] else 'NOT within'} {100 * r['tolerance']:g} %"
                 f"{' (within noise: less than 2 standard errors from the bound)' if r.get('within_noise') else ''}.** "
                 f"1-min load average {result['loadavg_1m'][0]:.2f} at start, {result['loadavg_1m'][1]:.2f} at end.")
    lines += ["", "Client CPU: ours, its load threads' own CPU time over the run; AIPerf, its process tree's "
                  "(start-up and shutdown included)."]
    return lines


def _num(v, fmt: str = ".4g") -> str:
    return "" if v is None else format(v, fmt)

