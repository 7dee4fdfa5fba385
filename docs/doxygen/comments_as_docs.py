#!/usr/bin/env python3
"""Doxygen's INPUT_FILTER for qkv's public headers (docs/doxygen/Doxyfile).

qkv's headers are written to be read as the manual, ggml-style, with plain // comments. This filter shows them
to Doxygen as its own comments, so the reference is the headers' text and nothing is written twice:
- a // block directly above a declaration documents it (///); a blank line after it keeps it a plain comment
  (a file's or a section's opening);
- a // block above a run of declarations with no blank line between them (zeros, ones, full, …) documents
  each of them: the run becomes a Doxygen member group, whose text DISTRIBUTE_GROUP_DOC gives to every member;
- a // comment after a declaration on its line documents that declaration (///<), every name of it when the
  line declares several (`Tensor scale, shift;  // …`: a member group around the line);
- characters Doxygen would read as commands or HTML (\\ @ < >) are escaped in comment text.
The line count never changes, so Doxygen's line numbers are the header's.
"""
import re
import sys

COMMENT = re.compile(r"^(\s*)//(?![/!])\s?(.*)$")
TRAILING = re.compile(r"^(.*?[;,)}]|.*\bdefault;)(\s*)//(?![/!<])\s?(.*)$")
SCOPE_CHANGE = re.compile(r"^\s*(\}|public:|private:|protected:|#|namespace\b|template\s*<[^>]*>\s*$)")


def escape(text):
    text = text.replace("\\", "\\\\").replace("@", "\\@")
    return text.replace("<", "\\<").replace(">", "\\>").replace("&", "\\&")


def code_only(line):
    """The line without strings, character literals and a trailing comment (for counting braces)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split("//", 1)[0]


def run_after(lines, start):
    """The code lines from `start` up to a blank line, a comment, or a change of scope."""
    end = start
    while end < len(lines):
        line = lines[end]
        if not line.strip() or COMMENT.match(line) or line.strip().startswith("///"):
            break
        if end > start and SCOPE_CHANGE.match(line):
            break
        end += 1
    return end


def declarations(lines):
    """How many declarations the lines hold, or None if they open a scope they do not close (a class body)."""
    depth, count = 0, 0
    for line in lines:
        code = code_only(line)
        for ch in code:
            if ch in "{(":
                depth += 1
            elif ch in "})":
                depth -= 1
                if depth < 0:
                    return None
        if depth == 0 and code.rstrip().endswith((";", "}")):
            count += 1
    return count if depth == 0 else None


def declares_several(line):
    """A declaration of several names on one line: a comma outside (), <>, {} and before the final ';'."""
    code = code_only(line).rstrip()
    if not code.endswith(";"):
        return False
    depth = 0
    for ch in code:
        if ch in "(<{[":
            depth += 1
        elif ch in ")>}]":
            depth -= 1
        elif ch == "," and depth == 0:
            return True
    return False


def convert_trailing(line):
    m = TRAILING.match(line)
    if not m or code_only(line).strip() == "":
        return line
    return f"{m.group(1)}{m.group(2)}///< {escape(m.group(3))}"


def main(path):
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    closing = ""  # "/** @} */ " when a group opened on the line before must close where this line starts

    def emit(line):
        nonlocal closing
        out.append(closing + line if closing else line)
        closing = ""

    while i < len(lines):
        m = COMMENT.match(lines[i])
        if not m:
            converted = convert_trailing(lines[i])
            reopen = converted != lines[i] and declares_several(lines[i]) and i + 1 < len(lines)
            if reopen:
                indent = re.match(r"\s*", converted).group(0)
                converted = f"{indent}/** @{{ */ " + converted.lstrip()
            emit(converted)
            if reopen:
                closing = "/** @} */ "
            i += 1
            continue
        block_start = i
        while i < len(lines) and COMMENT.match(lines[i]):
            i += 1
        block = lines[block_start:i]
        follows_code = i < len(lines) and lines[i].strip() and not lines[i].lstrip().startswith(("#", "}"))
        if not follows_code:
            for line in block:
                emit(line)
            continue
        docs = [f"{COMMENT.match(l).group(1)}/// {escape(COMMENT.match(l).group(2))}" for l in block]
        end = run_after(lines, i)
        run = lines[i:end]
        count = declarations(run)
        if count is not None and count >= 1:
            # A member group: its opening rides on the comment's first line and its closing on the run's last, so no
            # line is added.
            indent = COMMENT.match(block[0]).group(1)
            docs[0] = f"{indent}/** @{{ */ " + docs[0].lstrip()
            for line in docs:
                emit(line)
            converted = [convert_trailing(l) for l in run]
            # The group closes after the run's last line; after a trailing ///< it closes where the next line starts
            # (inside the comment the marker would be text, and before it the comment would go to the next member).
            trailing_doc = "///<" in converted[-1]
            if not trailing_doc:
                converted[-1] += " /** @} */"
            for line in converted:
                emit(line)
            if trailing_doc:
                closing = "/** @} */ "
            i = end
        else:
            for line in docs:
                emit(line)
    sys.stdout.write("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
