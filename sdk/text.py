"""Untrusted text made safe to put in front of a model.

A plugin that quotes text it did not write into a prompt (a document's chunk, a remembered
fact, a web page) passes it through :func:`defang` first, so that nothing in it reads as the
chat template's own control tokens or as the start of another turn.
"""

from __future__ import annotations

import re
import unicodedata

_NEWLINES = str.maketrans({"\x0b": "\n", "\x0c": "\n", "\x85": "\n", "\u2028": "\n", "\u2029": "\n"})
#: Control, format (zero-width, bidi, tag characters), surrogate and private-use characters.
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Co"})
#: Runs of characters other than printable ASCII, newline and tab: the only ones worth a look.
_SUSPECT = re.compile(r"[^\t\n\x20-\x7e]+")
_TOKENS = (
    # <|im_start|>, <|eot_id|>, <|start_header_id|>, DeepSeek's <｜User｜> ...
    (re.compile(r"<[|｜]([^\s<>|｜]{0,64})[|｜]>"), r"‹\1›"),
    (re.compile(r"<(/?)(s|bos|eos|pad|unk|start_of_turn|end_of_turn|think|tool_call|tool_response|tools"
                r"|start_of_image|end_of_image)>", re.IGNORECASE), r"‹\1\2›"),
    (re.compile(r"\[(/?)(INST|SYSTEM_PROMPT|AVAILABLE_TOOLS|TOOL_CALLS|TOOL_RESULTS|TOOL_CONTENT|THINK)\]"),
     r"‹\1\2›"),
    (re.compile(r"<<(/?)SYS>>"), r"‹\1SYS›"),
)
#: A line that is only a role header: "System:", "### Assistant:"; Alpaca's only after "#".
_ROLE_LINE = re.compile(r"^([ \t]*(?:#{1,6}[ \t]*)?)(system|user|assistant|human|developer|instruction|response"
                        r"|input)([ \t]*:[ \t]*)$", re.IGNORECASE | re.MULTILINE)
_ALPACA = frozenset({"instruction", "response", "input"})


def defang(text: str) -> str:
    """Untrusted text made safe to quote in a prompt, still readable; idempotent.

    Drops invisible characters (controls but newline and tab, zero-width, bidi overrides,
    private use), and respells chat-template tokens and bare role-header lines with
    ``‹ ›`` so that no tokenizer or reader takes them for the start of a turn.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_NEWLINES)
    text = _SUSPECT.sub(_visible, text)
    changed = True
    while changed:  # a respelled token can complete an outer one: <|<|x|>|>
        before = text
        for pattern, spelling in _TOKENS:
            text = pattern.sub(spelling, text)
        changed = text != before
    return _ROLE_LINE.sub(_respell_role, text)


def _visible(m: re.Match[str]) -> str:
    return "".join(c for c in m.group(0) if unicodedata.category(c) not in _INVISIBLE)


def _respell_role(m: re.Match[str]) -> str:
    lead, role, colon = m.groups()
    if role.lower() in _ALPACA and "#" not in lead:
        return m.group(0)
    return f"{lead}‹{role}›{colon}"
