"""A small tokenizer shared by the loop-IR text parser and the C front end.

Tokens carry 1-based line and column so every parse error can point at its source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

from ..errors import ParseError

_NUMBER = re.compile(r"(0[xX][0-9a-fA-F]+|(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?)([fFlLuU]*)")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRING = re.compile(r'"([^"\\\n]*)"')


@dataclass(frozen=True)
class Token:
    kind: str  # "ident" | "number" | "string" | "punct" | "eof"
    text: str
    line: int
    col: int
    start: int
    end: int
    suffix: str = ""  # C literal suffix such as "f"


class TokenStream:
    """Tokens of ``text`` with one-token lookahead.

    ``puncts`` lists the punctuation tokens, longest first.  ``hash_lines`` skips lines that
    start with ``#`` (C preprocessor directives); ``//`` and ``/* */`` comments are skipped.
    """

    def __init__(self, text: str, puncts: tuple[str, ...], hash_lines: bool = False):
        self.text = text
        self.lines = text.split("\n")
        self.tokens = self._tokenize(text, tuple(sorted(puncts, key=len, reverse=True)), hash_lines)
        self.pos = 0
        self.last: Token | None = None

    # ---------------------------------------------------------------- lexing
    def _tokenize(self, text: str, puncts: tuple[str, ...], hash_lines: bool) -> list[Token]:
        out: list[Token] = []
        i, n = 0, len(text)
        line_starts = [0]
        for m in re.finditer("\n", text):
            line_starts.append(m.end())

        def loc(pos: int) -> tuple[int, int]:
            lo, hi = 0, len(line_starts) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if line_starts[mid] <= pos:
                    lo = mid
                else:
                    hi = mid - 1
            return lo + 1, pos - line_starts[lo] + 1

        at_line_start = True
        while i < n:
            c = text[i]
            if c == "\n":
                at_line_start = True
                i += 1
                continue
            if c in " \t\r\f\v":
                i += 1
                continue
            if hash_lines and c == "#" and at_line_start:
                while i < n and text[i] != "\n":
                    i = i + 2 if text.startswith("\\\n", i) else i + 1
                continue
            at_line_start = False
            if text.startswith("//", i):
                while i < n and text[i] != "\n":
                    i += 1
                continue
            if text.startswith("/*", i):
                j = text.find("*/", i + 2)
                if j < 0:
                    self._fail_at("unterminated comment", *loc(i))
                i = j + 2
                continue
            line, col = loc(i)
            m = _NUMBER.match(text, i) if (c.isdigit() or (c == "." and text[i + 1:i + 2].isdigit())) else None
            if m:
                out.append(Token("number", m.group(1), line, col, i, m.end(), m.group(4)))
                i = m.end()
                continue
            m = _IDENT.match(text, i)
            if m:
                out.append(Token("ident", m.group(0), line, col, i, m.end()))
                i = m.end()
                continue
            m = _STRING.match(text, i)
            if m:
                out.append(Token("string", m.group(1), line, col, i, m.end()))
                i = m.end()
                continue
            for p in puncts:
                if text.startswith(p, i):
                    out.append(Token("punct", p, line, col, i, i + len(p)))
                    i += len(p)
                    break
            else:
                self._fail_at(f"unexpected character {c!r}", line, col)
        line, col = loc(n)
        out.append(Token("eof", "", line, col, n, n))
        return out

    # ---------------------------------------------------------------- access
    def peek(self, k: int = 0) -> Token:
        return self.tokens[min(self.pos + k, len(self.tokens) - 1)]

    def next(self) -> Token:
        tok = self.tokens[self.pos]
        if tok.kind != "eof":
            self.pos += 1
        self.last = tok
        return tok

    def peek_is(self, punct: str) -> bool:
        tok = self.peek()
        return tok.kind == "punct" and tok.text == punct

    def peek_word(self, word: str) -> bool:
        tok = self.peek()
        return tok.kind == "ident" and tok.text == word

    def accept(self, punct: str) -> bool:
        if self.peek_is(punct):
            self.next()
            return True
        return False

    def expect(self, punct: str) -> Token:
        tok = self.next()
        if tok.kind != "punct" or tok.text != punct:
            self.fail(f"expected '{punct}'", tok)
        return tok

    def expect_ident(self) -> Token:
        tok = self.next()
        if tok.kind != "ident":
            self.fail("expected a name", tok)
        return tok

    def expect_word(self, word: str) -> Token:
        tok = self.next()
        if tok.kind != "ident" or tok.text != word:
            self.fail(f"expected '{word}'", tok)
        return tok

    def expect_end(self) -> None:
        tok = self.peek()
        if tok.kind != "eof":
            self.fail("unexpected text after the end", tok)

    def fail(self, message: str, tok: Token) -> NoReturn:
        found = "end of input" if tok.kind == "eof" else repr(tok.text)
        self._fail_at(f"{message}, found {found}", tok.line, tok.col)

    def _fail_at(self, message: str, line: int, col: int) -> NoReturn:
        source = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        raise ParseError(message, line, col, source)
