"""Chat templates: found in the tokenizer folder, rendered with jinja2 as transformers'
``apply_chat_template`` does (``add_generation_prompt`` true), and the ``messages`` input parsed."""
import json
import os


def load_chat_template(folder):
    """The chat template text: ``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of {name, template} where ``default`` wins); None if none."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = _tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _tokenizer_config(folder):
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def special_tokens(folder):
    """``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` strings of tokenizer_config.json,
    the variables transformers passes to a chat template."""
    config, out = _tokenizer_config(folder), {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def render_chat(template, messages, special):
    """Render ``messages`` (list of {"role", "content"}) with a jinja chat template the way
    transformers does: sandboxed, trim_blocks/lstrip_blocks, ``raise_exception``, a ``tojson``
    that keeps non-ASCII, ``{% generation %}`` blocks, ``add_generation_prompt`` true.

    Raises:
        ValueError: the template raised (``raise_exception``) or failed to render.
    """
    import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens
        with it): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed to render messages: {e}") from e


def parse_messages(value):
    """``messages`` JSON text -> list of {"role": str, "content": str}.

    Raises:
        ValueError: not JSON, not a non-empty list, or an entry without string role and content.
    """
    try:
        messages = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"messages must be a JSON list of {{\"role\", \"content\"}} objects: {e}") from e
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise ValueError("messages must be a non-empty JSON list of objects with string 'role' and 'content'; "
                         f"got {value[:200]!r}")
    return messages

