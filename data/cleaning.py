"""Cleaning steps written for code: secret and PII redaction with a report, the licence filter, quality filters,
and the counter every removing step reports its documents and tokens to.

Deduplication is datatrove's (exact: content hash; near: MinHash LSH), wired in `data.pipeline`; these are the
steps datatrove has no code version of. Email and public-IP patterns are datatrove's own (`PIIFormatter`).
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.formatters.pii import PIIFormatter, public_ip_validator

from composer.data.tokenizer import text_tokenizer
from composer.recipes.schema import CleaningSection
from composer.runtime.run_dir import atomic_write_text


@functools.cache
def _tokenizer(file: str):
    return text_tokenizer(Path(file))


def count_tokens(tokenizer_file: Path, texts: list[str]) -> int:
    """Tokens of `texts` as the shaping step would count them (no special tokens added)."""
    return sum(len(e.ids) for e in _tokenizer(str(tokenizer_file)).encode_batch_fast(texts, add_special_tokens=False))


class RemovedTally:
    """Stands in as a datatrove step's exclusion writer: counts the documents the step drops, their tokens and
    their reasons, and writes them for this task to `folder/<step>/<rank>.json` when the step ends (a rerun of a
    killed task writes the file again)."""

    def __init__(self, folder: Path, step: str, tokenizer_file: Path):
        self.folder, self.step, self.tokenizer_file = folder, step, tokenizer_file

    def __enter__(self) -> RemovedTally:
        self.documents, self.tokens, self.reasons = 0, 0, Counter()
        return self

    def write(self, document: Document, rank: int = 0) -> None:
        self.rank = rank
        self.documents += 1
        self.tokens += count_tokens(self.tokenizer_file, [document.text])
        self.reasons[document.metadata.get("filter_reason") or self.step] += 1

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.documents:
            record = {"documents": self.documents, "tokens": self.tokens, "reasons": dict(self.reasons)}
            atomic_write_text(self.folder / self.step / f"{self.rank:05d}.json", json.dumps(record))


def read_tallies(folder: Path) -> dict[str, dict]:
    """Every step's removals, summed over tasks."""
    out: dict[str, dict] = {}
    for file in sorted(folder.glob("*/*.json")) if folder.is_dir() else ():
        record = json.loads(file.read_text())
        total = out.setdefault(file.parent.name, {"documents": 0, "tokens": 0, "reasons": Counter()})
        total["documents"] += record["documents"]
        total["tokens"] += record["tokens"]
        total["reasons"].update(record["reasons"])
    return out


# --- redaction ---------------------------------------------------------------------------------

SECRET_PATTERNS = {
    "private_key": r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----",
    "aws_access_key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "github_token": r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b",
    "slack_token": r"\bxox[abprs]-[A-Za-z0-9-]{10,}\b",
    "google_api_key": r"\bAIza[0-9A-Za-z_\-]{35}\b",
    "stripe_key": r"\b[sr]k_(?:live|test)_[0-9A-Za-z]{16,}\b",
    "openai_key": r"\bsk-(?:proj-)?[A-Za-z0-9_\-]{32,}\b",
    "jwt": r"\beyJ[A-Za-z0-9_\-]{10,}\.eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}",
}
# The value of a password/secret/token assignment; only values that look like one (a digit or a capital, no
# template syntax) so that `password = "password"` in a test stays.
ASSIGNED_SECRET = re.compile(
    r"""(?i)\b(?:password|passwd|pwd|secret|secret_key|client_secret|api_key|apikey|access_key|access_token|auth_token|token)\b"""
    r"""["']?\s*[:=]\s*(["'])(?P<value>(?=[^"'\s]*[0-9A-Z])[^"'\s{}<>$%]{8,})\1"""
)


class Redactor(PipelineStep):
    """Replaces secrets and PII with `<REDACTED_KIND>` and writes what it replaced (document, path, kind, line;
    never the value) to `report_folder/<rank>.jsonl`."""

    type = "✂️ - FORMAT"
    name = "composer redaction"

    def __init__(self, cleaning: CleaningSection, report_folder: Path):
        super().__init__()
        self.cleaning, self.report_folder = cleaning, report_folder
        pii = PIIFormatter()
        self.patterns: list[tuple[str, re.Pattern, object]] = []
        if cleaning.redact_secrets:
            self.patterns += [(kind, re.compile(p), None) for kind, p in SECRET_PATTERNS.items()]
            self.patterns.append(("assigned_secret", ASSIGNED_SECRET, None))
        if cleaning.redact_pii:
            self.patterns += [("email", pii.emails_replacer.regex, None), ("ip_address", pii.ip_replacer.regex, public_ip_validator)]

    def redact(self, text: str) -> tuple[str, list[tuple[str, int]]]:
        """The redacted text and (kind, line) of each replacement."""
        found = []
        for kind, pattern, valid in self.patterns:
            def replace(match: re.Match, kind=kind, valid=valid) -> str:
                if valid is not None and not valid(match.group(0)):
                    return match.group(0)
                found.append((kind, text.count("\n", 0, match.start()) + 1))
                if "value" in pattern.groupindex:  # keep the name and the quotes, replace the value
                    start, end = match.span("value")
                    return match.group(0)[: start - match.start()] + f"<REDACTED_{kind.upper()}>" + match.group(0)[end - match.start():]
                return f"<REDACTED_{kind.upper()}>"

            text = pattern.sub(replace, text)
        return text, found

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        lines = []
        for document in data:
            with self.track_time():
                document.text, found = self.redact(document.text)
            for kind, line in found:
                self.stat_update(f"redacted_{kind}")
                lines.append(json.dumps({"id": document.id, "path": document.metadata.get("path", ""), "kind": kind, "line": line}))
            yield document
        atomic_write_text(self.report_folder / f"{rank:05d}.jsonl", "".join(line + "\n" for line in lines))


# --- licences ----------------------------------------------------------------------------------

LICENSE_FILE = re.compile(r"(?i)^(?:licen[cs]e|copying)(?:[-._][\w.-]*)?$")
# First match wins: the more specific texts come before the ones they contain.
LICENSE_RULES = [
    ("AGPL-3.0", ("GNU AFFERO GENERAL PUBLIC LICENSE",)),
    ("LGPL-3.0", ("GNU LESSER GENERAL PUBLIC LICENSE", "Version 3")),
    ("LGPL-2.1", ("GNU LESSER GENERAL PUBLIC LICENSE",)),
    ("GPL-3.0", ("GNU GENERAL PUBLIC LICENSE", "Version 3")),
    ("GPL-2.0", ("GNU GENERAL PUBLIC LICENSE",)),
    ("Apache-2.0", ("Apache License", "Version 2.0")),
    ("MPL-2.0", ("Mozilla Public License", "2.0")),
    ("PSF-2.0", ("PYTHON SOFTWARE FOUNDATION LICENSE",)),
    ("Unlicense", ("This is free and unencumbered software released into the public domain",)),
    ("CC0-1.0", ("CC0 1.0 Universal",)),
    ("ISC", ("Permission to use, copy, modify, and/or distribute this software for any purpose",)),
    ("MIT", ("Permission is hereby granted, free of charge",)),
    ("BSD-3-Clause", ("Redistribution and use in source and binary forms", "Neither the name")),
    ("BSD-2-Clause", ("Redistribution and use in source and binary forms",)),
    ("Zlib", ("This software is provided 'as-is', without any express or implied warranty",)),
]


def repository_license(files: dict[str, str]) -> str | None:
    """The licence a repository declares in a top-level LICENSE/LICENCE/COPYING file: an SPDX id, `unrecognised`
    for a licence file these rules do not know, None when it declares none."""
    declared = [text for path, text in sorted(files.items()) if "/" not in path and LICENSE_FILE.match(path)]
    if not declared:
        return None
    text = " ".join(declared[0].split())
    for spdx, phrases in LICENSE_RULES:
        if all(" ".join(p.split()) in text for p in phrases):
            return spdx
    return "unrecognised"


class LicenseFilter(BaseFilter):
    """Drops every file of a repository whose declared licence is not allowed (undeclared: kept)."""

    name = "composer licence"

    def __init__(self, allowed: list[str], exclusion_writer: RemovedTally):
        super().__init__(exclusion_writer)
        self.allowed = set(allowed)

    def filter(self, document: Document) -> bool | tuple[bool, str]:
        declared = document.metadata.get("license")
        return declared is None or declared in self.allowed or (False, f"license {declared}")


# --- quality -----------------------------------------------------------------------------------

GENERATED_MARKERS = ("auto-generated", "autogenerated", "automatically generated", "generated by", "do not edit", "code generated")
GENERATED_LINES = 5
"""Lines at the top of a file searched for GENERATED_MARKERS."""
_ALPHANUMERIC = re.compile(r"[^\W_]+")


class QualityFilter(BaseFilter):
    """Drops documents with an overlong line, long lines on average, few letters and digits, or a generated-file
    marker near the top; the reason is counted."""

    name = "composer quality"

    def __init__(self, cleaning: CleaningSection, exclusion_writer: RemovedTally):
        super().__init__(exclusion_writer)
        self.cleaning = cleaning

    def filter(self, document: Document) -> bool | tuple[bool, str]:
        c, text = self.cleaning, document.text
        lines = text.splitlines() or [""]
        lengths = [len(line) for line in lines]
        if max(lengths) > c.max_line_length:
            return False, "line_too_long"
        if sum(lengths) / len(lengths) > c.max_mean_line_length:
            return False, "mean_line_too_long"
        alphanumeric = len(text) - len(_ALPHANUMERIC.sub("", text))
        if alphanumeric < c.min_alphanumeric_fraction * len(text):
            return False, "few_alphanumeric"
        if c.drop_generated:
            head = "\n".join(lines[:GENERATED_LINES]).lower()
            if any(marker in head for marker in GENERATED_MARKERS):
                return False, "generated"
        return True
