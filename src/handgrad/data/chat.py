"""Conversations for fine-tuning (SFT): reading chats.jsonl, and rendering it with the model's chat
template into tokens and the mask of assistant tokens. data/chat_data.py builds the chat data
directory from them and reads it back (ChatDataset).

`handgrad prepare chats.jsonl --format chat --tokenizer HF_DIR --out DATA` reads one
`{"messages": [...]}` object a line (read_conversations) and renders each with the model's own
template as transformers' apply_chat_template does (load_chat_format). The loss then counts
assistant tokens only.

The non-obvious idea, the assistant mask: the template is applied prefix by prefix. For an
assistant turn k, messages[:k] rendered with add_generation_prompt=True ends where the turn's text
begins, and messages[:k+1] ends where it ends (or, as in Qwen3's, which drops an earlier reply's
<think> block, the turn ends at its end-of-turn token); a token is an assistant token when its span
overlaps such a turn, up to its first end-of-turn token (ChatFormat.encode). So no per-model rule says
where replies start.
"""
import json
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .sources import DataError
from .gguf_tokenizer import is_gguf
from .tokenizer import TOKENIZER_FILE, load_tokenizer


CHAT_FILE = "chat.json"
CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "user", "assistant")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|im_start|>assistant\\n' }}{% endif %}")
PLAIN_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
                  "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
                  "{% else %}{{ 'Assistant: ' + message['content'] + eos_token + '\\n' }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>")


# ---------------------------------------------------------------- the template
class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    from datetime import datetime
    return datetime.now().strftime(fmt)


def compile_template(text: str, where: str):
    """The jinja2 template, in transformers' apply_chat_template environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"{where}: the chat template is not valid jinja2 (line {e.lineno}: {e.message})") from None


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatFormat:
    """A chat template with its special tokens, over the Hugging Face tokenizer it renders for.

    hf: a tokenizers.Tokenizer that recognises special tokens in text; template: the jinja2 text;
    special: {"bos_token": ..., "eos_token": ...}; where: names the tokenizer in errors."""

    def __init__(self, hf, template: str, special: dict, where: str, source: str):
        self.hf, self.template, self.special, self.where, self.source = hf, template, dict(special), where, source
        self._compiled = compile_template(template, where)
        self.end_of_turn = self._find_end_of_turn()
        self.end_of_turn_id = int(hf.token_to_id(self.end_of_turn))

    def render(self, messages, add_generation_prompt=False) -> str:
        """The template's text for `messages`; DataError (no location) when the template raises."""
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special)
        except Exception as e:  # raise_exception, a missing key, a type error in the template
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"the chat template refuses this conversation ({reason})") from None

    def _find_end_of_turn(self) -> str:
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]
        try:
            start, whole = self.render(probe[:1], True), self.render(probe)
        except DataError as e:
            raise DataError(f"{self.where}: {e} for a plain user/assistant exchange; cannot use it") from None
        tail = whole[len(start):] if whole.startswith(start) else ""
        after = tail[tail.find("Yes") + 3:] if "Yes" in tail else ""
        specials = [t.content for t in self.hf.get_added_tokens_decoder().values() if t.special]
        found = sorted((after.find(s), s) for s in specials if s in after)
        if not found:
            raise DataError(f"{self.where}: the chat template writes no special token after an assistant turn, so "
                            f"a reply could not end; add an eos_token the template uses, or a chat_template")
        return found[0][1]

    def encode(self, messages) -> tuple[np.ndarray, np.ndarray]:
        """(ids (n,) int64, mask (n,) uint8) of one conversation: mask[i] = 1 on assistant tokens.
        DataError (no location) where the template cannot be used.

        The spans of the assistant turns come from rendering prefixes: messages[:k] with
        add_generation_prompt=True must be a prefix of the whole text (else the template is refused as
        not prefix-stable), where the turn begins; it ends where messages[:k+1] ends when that is a
        prefix too, else at its first end-of-turn token (Qwen3's template writes a <think> block into
        the last reply only, so a reply renders otherwise once a question follows it). A token is an
        assistant token when its character span overlaps a turn's span, up to and including the first
        end-of-turn token in it: the turn's content and its end-of-turn token, nothing the template
        writes after that. The end-of-turn
        token is the first special token the template writes after an assistant turn's content
        (<|im_end|> for ChatML, </s> for Llama 2); generation stops at it (`sample --chat`)."""
        text = self.render(messages)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, upto = self.render(messages[:k], add_generation_prompt=True), self.render(messages[:k + 1])
            if not text.startswith(before):
                raise DataError(f"the chat template renders message {k + 1} differently once later messages "
                                f"follow (not prefix-stable), so its tokens cannot be located; use another "
                                f"chat_template")
            stable = upto.startswith(before) and text.startswith(upto)
            spans.append((len(before), len(upto) if stable else len(text), stable, k))
        enc = self.hf.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)  # (n,)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)  # (n, 2) character spans
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b, stable, k in spans:
            inside = np.flatnonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))
            ends = inside[ids[inside] == self.end_of_turn_id]
            if not (stable or len(ends)):  # a turn found by its end-of-turn token, which is not there
                raise DataError(f"the chat template ends message {k + 1} with no {self.end_of_turn} once later "
                                f"messages follow, so its tokens cannot be located; use another chat_template")
            mask[inside[inside <= ends[0]] if len(ends) else inside] = 1
        return ids, mask

    def prompt_ids(self, messages) -> list[int]:
        """The ids that ask the model for the next assistant turn (add_generation_prompt=True)."""
        return self.hf.encode(self.render(messages, add_generation_prompt=True), add_special_tokens=False).ids

    def to_json(self) -> dict:
        return {"chat_template": self.template, "special_tokens": self.special, "template_source": self.source,
                "end_of_turn": self.end_of_turn, "end_of_turn_id": self.end_of_turn_id}


def read_json_file(path: Path):
    """The JSON in path; DataError naming the file where it cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON ({getattr(e, 'strerror', None) or e})") from None


def load_chat_format(path) -> ChatFormat:
    """The chat format of a Hugging Face model directory, a tokenizer.json, a GGUF model file (its
    tokenizer.chat_template and special tokens), or a chat data or run directory (its chat.json).
    Its tokenizer.json must be a Hugging Face tokenizers file.

    The template is the model's own (`chat_template.jinja`, or tokenizer_config.json's
    `chat_template`), rendered as transformers' apply_chat_template does (compile_template: a jinja2
    ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loopcontrols, `tojson`,
    `raise_exception`, `strftime_now`; variables `messages`, `add_generation_prompt` and the special
    tokens; `{% generation %}` blocks render their body). With no template: ChatML (CHATML_TEMPLATE)
    where the tokenizer has <|im_start|> and <|im_end|>, else PLAIN_TEMPLATE ("User: ...\\n",
    "Assistant: ..." and the eos token). The text is tokenised with special tokens recognised
    (add_special_tokens=False, as apply_chat_template does)."""
    from tokenizers import Tokenizer as HFTokenizer
    path = Path(path)
    if is_gguf(path):
        tok = load_tokenizer(path)
        hf = HFTokenizer.from_str(tok.hf.to_str())
        hf.encode_special_tokens = False  # the template's special tokens are special
        return _template_format(hf, tok.config, {}, path, None)
    d, file = (path, path / TOKENIZER_FILE) if path.is_dir() else (path.parent, path)
    hint = "chat needs a Hugging Face tokenizer (a model directory's tokenizer.json)"
    if not file.is_file():
        raise DataError(f"{file}: no tokenizer file; {hint}")
    doc = read_json_file(file)
    if not isinstance(doc, dict) or "model" not in doc:
        raise DataError(f"{file}: not a Hugging Face tokenizers file; {hint}")
    try:
        hf = HFTokenizer.from_str(json.dumps(doc))
    except Exception as e:  # tokenizers raises a plain Exception for a bad file
        raise DataError(f"{file}: not a valid Hugging Face tokenizer file ({str(e).splitlines()[0]})") from None
    hf.encode_special_tokens = False  # the template's special tokens are special
    if (d / CHAT_FILE).is_file():
        saved = read_json_file(d / CHAT_FILE)
        if not (isinstance(saved, dict) and isinstance(saved.get("chat_template"), str)
                and isinstance(saved.get("special_tokens"), dict)):
            raise DataError(f"{d / CHAT_FILE}: missing or invalid chat_template/special_tokens; prepare the "
                            f"data again")
        return ChatFormat(hf, saved["chat_template"], saved["special_tokens"], str(d / CHAT_FILE),
                          saved.get("template_source", CHAT_FILE))
    config = read_json_file(d / CONFIG_FILE) if (d / CONFIG_FILE).is_file() else {}
    config = config if isinstance(config, dict) else {}
    extra = read_json_file(d / "special_tokens_map.json") if (d / "special_tokens_map.json").is_file() else {}
    return _template_format(hf, config, extra, file, d)


def _template_format(hf, config, extra, file, d):
    """The ChatFormat of a tokenizer's settings: config (tokenizer_config.json's, or a GGUF's) with
    special_tokens_map.json's `extra` and, where d is a directory, its chat_template.jinja."""
    special = {}
    for name in SPECIAL_NAMES:
        value = _token_text(config.get(name)) or (_token_text(extra.get(name)) if isinstance(extra, dict) else None)
        if value is not None:
            special[name] = value
    template, source = config.get("chat_template"), CONFIG_FILE if d is not None else "tokenizer.chat_template"
    if isinstance(template, list):  # several named templates: the "default" one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if d is not None and (d / "chat_template.jinja").is_file():
        template, source = (d / "chat_template.jinja").read_text(encoding="utf-8"), "chat_template.jinja"
    if template is not None and not isinstance(template, str):
        raise DataError(f"{d / CONFIG_FILE if d is not None else file}: chat_template must be a string; fix the file")
    vocab = hf.get_vocab(with_added_tokens=True)
    if template is None and "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        template, source = CHATML_TEMPLATE, "default ChatML"
    elif template is None:
        template, source = PLAIN_TEMPLATE, "default plain"
        special.setdefault("eos_token", next((t for t in EOS_CANDIDATES if t in vocab), None))
        if special["eos_token"] is None:
            raise DataError(f"{file}: no chat_template and no eos_token to end assistant turns with; add "
                            f"eos_token (or a chat_template) to {d / CONFIG_FILE if d is not None else 'its metadata'}")
    return ChatFormat(hf, template, special, str(file), source)


# ---------------------------------------------------------------- reading chats.jsonl
def read_conversations(path):
    """(line number, messages) for each non-blank line of a chats.jsonl, checked: one JSON object a
    line, `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}` (the OpenAI /
    Hugging Face convention). A line that is not JSON, a role other than these three, an assistant
    turn with no text or a conversation without one stops prepare with one line naming the file and
    line (so does one the template refuses, its raise_exception, in build_chat_data)."""
    return read_jsonl(path, _check_line, "a chats.jsonl file", '{"messages": [...]}')


def read_jsonl(path, check, what, layout):
    """(line number, check(the line's JSON value, "path:line")) for each non-blank line of a UTF-8
    JSONL file of `what`, each line one `layout` object; a file that cannot be read, a line that is
    not JSON or not UTF-8 is a DataError naming the file (and line)."""
    path = Path(path)
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e}); give {what}") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); each line must "
                                    f"be one {layout} object") from None
                yield lineno, check(doc, f"{path}:{lineno}")
        except UnicodeDecodeError:
            raise DataError(f"{path}:{lineno + 1}: not UTF-8 text; save the file as UTF-8") from None


def check_messages(messages, where: str, what: str = ""):
    """Each message an object with a string "content" and a role of ROLES; a DataError at `where`
    naming the message (`what`: whose messages, as '"prompt" ')."""
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {what}message {i} must be an object with a string \"content\"")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: {what}message {i} has role {m.get('role')!r}; roles are system, user and "
                            f"assistant")


def _check_line(doc, where: str) -> list:
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected an object with a non-empty \"messages\" list")
    check_messages(messages, where)
    for i, m in enumerate(messages, 1):
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: message {i} is an empty assistant turn; give it text or drop it")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to learn; add one or drop "
                        f"the line")
    return messages
