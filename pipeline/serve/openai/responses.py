"""OpenAI's ``logprobs`` bodies from a finished :class:`pipeline.serve.openai.bridge.Run`:
the completions form (tokens, token_logprobs, top_logprobs, text_offset) and the chat form
(content: token, logprob, bytes, top_logprobs). Token texts are what each id adds to the
decoded text (:func:`token_strings`)."""
from __future__ import annotations

from collections.abc import Sequence

from pipeline.serve.openai.bridge import Run
from pipeline.serve.openai.requests import CompletionRequest


def token_strings(tokenizer, ids: list[int], window: int = 6, context: Sequence[int] = ()) -> list[str]:
    """Each token's text as it adds to the decoded text (special tokens kept): the decode of a
    few tokens before it and itself, less the decode of those before it. ``context``: the ids
    before ``ids[0]`` (the prompt's, for generated tokens): a Metaspace word-initial token then
    keeps its space, as in the completion's text."""
    out = []
    head_ids = list(context)[-window:]
    seq = head_ids + list(ids)
    for i in range(len(head_ids), len(seq)):
        before = seq[max(0, i - window):i]
        head = tokenizer.decode(before, skip_special_tokens=False)
        whole = tokenizer.decode(before + [seq[i]], skip_special_tokens=False)
        out.append(whole[len(head):] if whole.startswith(head) else tokenizer.decode([seq[i]], skip_special_tokens=False))
    return out


def _top_dict(tokenizer, top: list | None, token: int, text: str) -> dict | None:
    if top is None:
        return None
    return {(text if i == token else tokenizer.decode([i], skip_special_tokens=False)): lp for i, lp in top}


def completion_choice(tokenizer, req: CompletionRequest, prompt, run: Run, text: str, index: int) -> dict:
    """One choice of a (non-streamed) completion: with ``echo`` the prompt's text comes first;
    ``logprobs`` {tokens, token_logprobs, top_logprobs, text_offset} covers the prompt tokens
    (echo; the first one's logprob is null) then the generated ones. ``text_offset`` indexes the
    tokens' decoded texts (special tokens kept) from the start of the choice's text."""
    echo_text = ""
    if req.echo:
        echo_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)
    logprobs = None
    if req.logprobs is not None:
        prompt_scores = run.prompt_scores if req.echo else None
        ids = (prompt_scores["ids"] if prompt_scores else []) + run.tokens
        values = (prompt_scores["logprobs"] if prompt_scores else []) + [t["logprob"] for t in run.token_scores]
        tops = (prompt_scores["top"] if prompt_scores else []) + [t["top"] for t in run.token_scores]
        strings = token_strings(tokenizer, ids, context=() if prompt_scores else (run.prompt_ids or ()))
        offsets, at = [], 0
        for piece in strings:
            offsets.append(at)
            at += len(piece)
        logprobs = {"tokens": strings, "token_logprobs": values,
                    "top_logprobs": [_top_dict(tokenizer, t, i, s) for t, i, s in zip(tops, ids, strings)],
                    "text_offset": offsets}
    return run._choice(echo_text + text, run.finish_reason, delta=False, index=index, logprobs=logprobs)


def chat_logprobs(tokenizer, run: Run) -> dict:
    """OpenAI's chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]} per generated token."""
    strings = token_strings(tokenizer, run.tokens, context=run.prompt_ids or ())
    content = []
    for token, text, score in zip(run.tokens, strings, run.token_scores):
        top = _top_dict(tokenizer, score["top"], token, text) or {}
        content.append({"token": text, "logprob": score["logprob"], "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top.items()]})
    return {"content": content}
