"""lm-evaluation-harness against the served model: its ``local-completions``
model scores a multiple-choice task through ``/v1/completions`` (echo + logprobs), its
``local-chat-completions`` model runs a ``generate_until`` task through ``/v1/chat/completions``.
Task YAMLs and data are written here (no hub). SmolLM2 (the session's fp8-llm run, minutes) must
score above chance on the Lee sentence-order task and match the validated graph in process; the
tiny LM (seconds) checks lm-eval's parsing value by value and the chat path; a stand-in server
without prompt logprobs shows the above-chance check fails at chance."""
from __future__ import annotations

import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, llm_overrides
from serve_tiny import stop_when_idle
from test_openai_api import stack  # noqa: F401  (the tiny LM on a real tritonserver + the endpoint)

lm_eval = pytest.importorskip("lm_eval")

MC_TASK, GEN_TASK = "lee_sentence_order", "short_answers"
CHOICES = 4
# SmolLM2 told the article's real third sentence from other articles' in 0.60 +- 0.078 of 40 questions
# (160 requests, the run's slowest test); from three word-shuffled copies of itself in 16 of 16 (FP32,
# in process) and 12 of 12 (served FP8). 12 questions: 48 requests, chance + 3 stderr far below.
QUESTIONS = 12
#: served vs in-process log-likelihood of one continuation (nats): the same FP8 Q/DQ graph with its
#: weights dequantized once, but the served one runs prefill in chunks (measured: below 0.00005)
LOGLIK_ATOL = 0.01
#: questions whose served log-likelihoods are recomputed in process (4 continuations each)
REFERENCE_QUESTIONS = 10


# --- task data and YAMLs ---------------------------------------------------------------------------------


def _sentences(document: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", document) if s.strip()]


def lee_sentence_order(n: int, start: int = 220) -> list[dict]:
    """``n`` questions from gensim's Lee corpus: the first two sentences of an article, and 4
    candidate third sentences (the article's own and three copies of it with its words shuffled);
    the true one is at index ``i % 4`` so a constant answer scores exactly chance."""
    from pipeline.sources.data.corpus import test_data_dir

    lines = (test_data_dir() / "lee_background.cor").read_text(encoding="latin-1").splitlines()
    docs = [_sentences(line) for line in lines[start:] if line.strip()]
    usable = [d for d in docs if len(d) >= 3 and len(" ".join(d[:2]).split()) <= 60 and 5 <= len(d[2].split()) <= 30]
    rng = np.random.default_rng(0)
    out = []
    for i, doc in enumerate(usable[:n]):
        words, shuffled = doc[2].split(), []
        while len(shuffled) < CHOICES - 1:
            copy = " ".join(rng.permutation(words))
            if copy != doc[2] and copy not in shuffled:
                shuffled.append(copy)
        gold = i % CHOICES
        out.append({"context": " ".join(doc[:2]), "choices": shuffled[:gold] + [doc[2]] + shuffled[gold:], "gold": gold})
    assert len(out) == n, f"only {len(out)} usable articles"
    return out


def write_task(folder: Path, task: str, docs: list[dict], spec: str) -> Path:
    """A local lm-eval task: ``docs`` as ``<task>.jsonl`` and its YAML (the json dataset, then ``spec``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{task}.yaml").write_text(
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n" + spec)
    return folder


def write_mc_task(folder: Path, docs: list[dict]) -> Path:
    return write_task(folder, MC_TASK, docs,
                      "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
                      "doc_to_choice: choices\ndoc_to_target: gold\ntarget_delimiter: \" \"\n"
                      "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
                      "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")


#: generate_until questions in the tiny LM's vocabulary (its tokenizer has byte tokens, its graph 11 ids)
GEN_DOCS = [{"question": "the cat sat on", "answer": "the mat"}, {"question": "the mat", "answer": "on"},
            {"question": "on the cat", "answer": "sat"}]


def write_gen_task(folder: Path, docs: list[dict]) -> Path:
    return write_task(folder, GEN_TASK, docs,
                      "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
                      "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
                      "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


def evaluate(model: str, model_args: dict, task: str, folder: Path, **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=[task],
                           task_manager=TaskManager(include_path=str(folder), include_defaults=False), log_samples=True, **kwargs)


def above_chance(acc: float, stderr: float, chance: float, k: float = 3.0) -> bool:
    """The score is at least ``k`` standard errors above chance."""
    return acc >= chance + k * stderr and acc > chance


# --- the self-test: an endpoint without prompt logprobs scores chance ------------------------------------


class FlatLogprobs(BaseHTTPRequestHandler):
    """/v1/completions answering like a server that does not compute prompt logprobs: every token
    gets log-probability 0, so every choice ties (what a missing ``logprobs`` amounts to)."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        choices = [{"index": i, "text": "", "finish_reason": "length",
                    "logprobs": {"tokens": ["x"] * (len(p) + 1), "token_logprobs": [None] + [0.0] * len(p),
                                 "top_logprobs": [None] + [{"x": 0.0}] * len(p), "text_offset": [0] * (len(p) + 1)}}
                   for i, p in enumerate(prompts)]
        payload = json.dumps({"id": "x", "object": "text_completion", "choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_a_server_without_prompt_logprobs_scores_chance_and_fails_the_check(tmp_path):
    from test_repository import tiny_tokenizer
    from transformers import PreTrainedTokenizerFast

    folder = tiny_tokenizer(tmp_path / "tok")  # any tokenizer: the stand-in ignores the tokens
    PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<eos>").save_pretrained(folder)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FlatLogprobs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tasks = write_mc_task(tmp_path / "tasks", lee_sentence_order(QUESTIONS))
        out = evaluate("local-completions", {"model": "flat", "base_url": f"http://127.0.0.1:{server.server_port}"
                                             "/v1/completions", "tokenizer": str(folder), "max_length": 512,
                                             "max_retries": 1}, MC_TASK, tasks)
    finally:
        server.shutdown()
    result = out["results"][MC_TASK]
    assert result["acc,none"] == pytest.approx(1 / CHOICES)  # ties: always the first choice, gold rotates
    assert not above_chance(result["acc,none"], result["acc_stderr,none"], 1 / CHOICES)


# --- the served SmolLM2 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(fp8_llm_run, llm_workspace):
    """tritonserver on the fp8-llm repository + the OpenAI endpoint; yields (server, endpoint,
    served context in tokens, run artifacts, tokenizer folder)."""
    pytest.importorskip("pytriton")
    from pipeline.recipe.load import load_recipe
    from pipeline.serve.openai.app import find_model_folder
    from pipeline.serve.run import launch, prepare_for_server, start_endpoint
    from pipeline.triton.config import parse_config

    assert fp8_llm_run.passed
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", llm_overrides(llm_workspace))
    served = prepare_for_server(recipe, fp8_llm_run.artifacts)
    config = parse_config((served.repository / served.generate_model / "config.pbtxt").read_text())
    context = int(config.parameters["max_context"].string_value)
    server = launch(served)
    try:
        endpoint = start_endpoint(served, server, port=0)
        try:
            yield server, endpoint, context, fp8_llm_run.artifacts, find_model_folder(served.repository,
                                                                                      served.generate_model)
        finally:
            endpoint.stop()
    finally:
        code = stop_when_idle(server, served.generate_model)
    assert code == 0, server.logs()[-3000:]


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of (context, continuation) into token ids (TemplateLM._encode_pair)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


def in_process_logliks(onnx_path: str, tok, pairs: list[tuple[str, str]]) -> list[float]:
    """Sum of the continuation tokens' log-probabilities under the validated FP8 graph (ONNX Runtime, one
    pass; a Q/DQ graph's weights dequantized once, as validate and the served model run it)."""
    from pipeline.runners.base import OrtRunner

    session = OrtRunner(onnx_path).session
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs()
            if i.name.startswith("past_key_values.")}
    out = []
    for context, continuation in pairs:
        ctx, cont = _encode_pair(tok, context, continuation)
        ids = ctx + cont
        logits = session.run(["logits"], {"input_ids": np.array([ids], np.int64),
                                          "attention_mask": np.ones((1, len(ids)), np.int64), **past})[0][0]
        x = logits.astype(np.float64)
        lp = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
        out.append(float(sum(lp[len(ctx) - 1 + j, t] for j, t in enumerate(cont))))
    return out


@pytest.mark.e2e
@pytest.mark.server
def test_lm_eval_multiple_choice_through_local_completions(smollm2, tmp_path, record_property):
    from transformers import AutoTokenizer

    server, endpoint, context, artifacts, folder = smollm2
    tasks = write_mc_task(tmp_path / "tasks", lee_sentence_order(QUESTIONS))
    args = {"model": server_model(endpoint), "base_url": endpoint.url + "/completions", "tokenizer": str(folder),
            "max_length": context - 1, "num_concurrent": 2, "max_retries": 1, "timeout": 600}
    out = evaluate("local-completions", args, MC_TASK, tasks)
    result = out["results"][MC_TASK]
    acc, stderr = result["acc,none"], result["acc_stderr,none"]
    record_property(MC_TASK, f"acc {acc:.3f} +- {stderr:.3f} over {QUESTIONS} questions")
    print(f"\n{MC_TASK}: acc {acc:.3f} +- {stderr:.3f} (chance {1 / CHOICES}) over {QUESTIONS} questions")
    assert above_chance(acc, stderr, 1 / CHOICES), (acc, stderr)
    # 12 of 12 has a standard error of 0: the exact binomial tail against chance says what it is worth
    from scipy.stats import binomtest

    assert binomtest(round(acc * QUESTIONS), QUESTIONS, 1 / CHOICES, alternative="greater").pvalue < 1e-3, acc

    samples = out["samples"][MC_TASK]
    pairs = [tuple(a) for s in samples for a in s["arguments"]]
    served = [float(r[0][0]) for s in samples for r in s["resps"]]
    assert len(served) == QUESTIONS * CHOICES and all(math.isfinite(v) and v < 0 for v in served)
    tok = AutoTokenizer.from_pretrained(str(folder))
    pairs, served = pairs[:REFERENCE_QUESTIONS * CHOICES], served[:REFERENCE_QUESTIONS * CHOICES]
    reference = in_process_logliks(artifacts["quantize"].onnx_path, tok, pairs)
    gap = np.abs(np.array(served) - np.array(reference))
    print(f"served vs in-process log-likelihood: max |diff| {gap.max():.4f} nats over {len(pairs)} continuations")
    assert gap.max() <= LOGLIK_ATOL, (gap.max(), pairs[int(gap.argmax())])


def server_model(endpoint) -> str:
    import httpx

    return httpx.get(endpoint.url + "/models", timeout=60).json()["data"][0]["id"]


# --- the tiny LM (seconds): lm-eval's parsing of what the endpoint returns ---------------------------------

TINY_DOCS = [{"context": "the cat sat on the", "choices": ["mat", "cat", "sat", "on"], "gold": 0},
             {"context": "the cat", "choices": ["sat", "on", "the", "mat"], "gold": 1},
             {"context": "on the mat the", "choices": ["cat", "mat", "on", "sat"], "gold": 2}]


@pytest.mark.server
def test_lm_eval_loglikelihoods_equal_the_graph_on_the_tiny_lm(stack, tmp_path):
    """lm-eval's multiple-choice log-likelihoods (token-id prompts, echo, ctxlen slicing) equal the
    served graph's, computed here in one pass (prompts under one prefill chunk)."""
    from test_openai_api import CONTEXT, MODEL
    from transformers import AutoTokenizer

    folder = stack.served.repository / MODEL / "1"
    tasks = write_mc_task(tmp_path / "tasks", TINY_DOCS)
    out = evaluate("local-completions", {"model": MODEL, "base_url": stack.open.url + "/completions",
                                         "tokenizer": str(folder), "max_length": CONTEXT, "max_retries": 1,
                                         "batch_size": 2}, MC_TASK, tasks)
    samples = out["samples"][MC_TASK]
    pairs = [tuple(a) for s in samples for a in s["arguments"]]
    served = [float(r[0][0]) for s in samples for r in s["resps"]]
    reference = in_process_logliks(stack.onnx_path, AutoTokenizer.from_pretrained(str(folder)), pairs)
    assert len(served) == 12 and all(v < 0 for v in served)
    np.testing.assert_allclose(served, reference, atol=1e-4)
    picks = [int(np.argmax(reference[4 * i:4 * i + 4])) for i in range(3)]
    assert out["results"][MC_TASK]["acc,none"] == pytest.approx(np.mean([p == d["gold"] for p, d in
                                                                         zip(picks, TINY_DOCS)]))


@pytest.mark.server
def test_lm_eval_local_completions_finds_the_remote_tokenizer_by_itself(stack):
    """lm-eval 0.4.13's ``local-completions`` (``tokenizer_backend=auto``) probes the server root for
    ``/tokenizer_info`` and ``/tokenize``; with them it needs no tokenizer argument and no hub."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    base_url = stack.open.url + "/completions"
    assert check_remote_tokenizer_support(base_url)
    remote = RemoteTokenizer(base_url, timeout=60)
    assert remote.eos_token == "<eos>" and remote.eos_token_id == 0 and remote.bos_token_id is None
    ids = stack.tok.encode("the cat sat", add_special_tokens=False).ids
    assert remote.encode("the cat sat") == ids and remote.decode(ids) == "the cat sat"


@pytest.mark.server
def test_lm_eval_generate_until_through_local_chat_completions(stack, tmp_path):
    """lm-eval's chat model on the tiny LM: what it scored is what the endpoint serves for the same
    messages and settings."""
    import openai

    from test_openai_api import MODEL

    tasks = write_gen_task(tmp_path / "tasks", GEN_DOCS)
    args = {"model": MODEL, "base_url": stack.open.url + "/chat/completions", "max_retries": 1,
            "tokenizer_backend": None}
    out = evaluate("local-chat-completions", args, GEN_TASK, tasks, apply_chat_template=True)
    result, samples = out["results"][GEN_TASK], out["samples"][GEN_TASK]
    assert len(samples) == len(GEN_DOCS) and 0.0 <= result["exact_match,none"] <= 1.0
    client = openai.OpenAI(base_url=stack.open.url, api_key="unused", max_retries=0, timeout=120)
    for sample in samples:
        messages = [{"role": "user", "content": sample["doc"]["question"]}]  # lm-eval's chat for a zero-shot task
        direct = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                stop=["\n"], seed=1234)
        assert sample["resps"][0][0] == direct.choices[0].message.content
        assert direct.choices[0].message.content  # the tiny LM says something
