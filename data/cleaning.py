"""Cleaning steps written for code: secret and PII redaction with a report, the licence filter, quality filters,
and the counter every removing step reports its documents and tokens to.

Deduplication is datatrove's (exact: content hash; near: MinHash LSH), wired in `data.pipeline`; these are the
steps datatrove has no code version of. Email and public-IP patterns are datatrove's own (`PIIFormatter`).
"""

from __future__ import annotations

import functools
import json
import math
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
#
# Detectors find spans of the original text (kind, start, end); overlaps go to the detector listed first, and each
# span is replaced by `<REDACTED_KIND>`: only the secret value, never the code around it. The token-shaped
# detectors are detect-secrets' own (Yelp's scanner for source code, `_library_detectors`), next to composer's
# patterns for what it misses: private-key blocks of every armor, URL credentials on any host, webhooks, and values
# next to secret-shaped names whose shape and entropy say key or password (`_assigned`).

SECRET_PATTERNS = {
    # PEM (RSA, EC, DSA, ENCRYPTED, OPENSSH...) and PGP armor; unterminated blocks run to the end of their body
    "private_key": r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----(?:[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
    r"|(?:\\n|[\s\"',])*(?:[A-Za-z0-9+/=:\- ]+(?:\\n|[\s\"',])+)*)"
    r"|---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----[\s\S]*?---- END SSH2 ENCRYPTED PRIVATE KEY ----"
    # PuTTY .ppk: the private lines and their MAC (the public half stays)
    r"|Private-Lines: *\d+(?:\\r)?(?:\\n|\r?\n)(?:[ \t]*[A-Za-z0-9+/=]+(?:\\r)?(?:\\n|\r?\n)?)+"
    r"(?:[ \t]*Private-(?:MAC|Hash): *[0-9a-fA-F]+)?",
    "aws_access_key": r"(?<![A-Za-z0-9])(?:A3T[A-Z0-9]|ABIA|ACCA|AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA)[0-9A-Z]{16}(?![A-Za-z0-9])",
    "github_token": r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})",
    "gitlab_token": r"(?<![A-Za-z0-9_])gl(?:pat|dt|rt|cbt|ptt|ft|imt|agent|oas|soat)-[A-Za-z0-9_\-]{20,}",
    "slack_token": r"(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9-]{10,}",
    "webhook": r"https?://(?:hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9_/\-]+"
    r"|(?:[\w-]+\.)?discord(?:app)?\.com/api/webhooks/\d+/[\w\-]+"
    r"|[\w.-]+\.webhook\.office\.com/webhookb2/[^\s\"'<>]+"
    r"|[\w.-]+\.logic\.azure\.com[:/][^\s\"'<>]*sig=[^\s\"'<>]+"
    r"|chat\.googleapis\.com/v1/spaces/[^\s\"'<>]*(?:key|token)=[^\s\"'<>]+"
    r"|hooks\.zapier\.com/hooks/catch/[\w/]+"
    r"|maker\.ifttt\.com/trigger/[^\s\"'<>]+/key/[\w\-]+"
    r"|api\.telegram\.org/bot\d+:[\w\-]+)",
    "google_api_key": r"(?<![A-Za-z0-9])AIza[0-9A-Za-z_\-]{35}",
    "stripe_key": r"(?<![A-Za-z0-9])(?:[sr]k|pk)_(?:live|test)_[0-9A-Za-z]{16,}",
    "openai_key": r"(?<![A-Za-z0-9])sk-(?:proj-|ant-(?:api|admin)\d\d-)?[A-Za-z0-9_\-]{32,}",
    "huggingface_token": r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}",
    "jwt": r"(?<![A-Za-z0-9])eyJ[A-Za-z0-9_\-]{10,}\.eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}",
    # scheme://user:PASSWORD@host, any host (a name with no dot, an address, a port)
    "url_password": r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s:/@\"'<>]+:(?P<value>[^\s/@\"'<>]+)@(?=[\w\[.\-])",
    # Authorization headers
    "bearer_token": r"(?i)\b(?:bearer|token|basic)\s+(?P<value>[A-Za-z0-9._~+/\-]{20,}=*)",
}

_SECRET_WORD = r"(?:pass|pwd|(?<![a-z])pw(?![a-z])|secret|token|api[_\-]?key|apikey|private[_\-]?key|credential|auth|access[_\-]?key|signing[_\-]?key|encryption[_\-]?key|master[_\-]?key|client[_\-]?key|session[_\-]?key|account[_\-]?key)"
# NAME (optionally quoted, a type annotation) then = : => := and a quoted or bare value; or a flag (--password x);
# or an XML element; or a getenv/setdefault pair ("NAME", "value").
ASSIGNED_SECRET = re.compile(
    r"(?i)(?<![A-Za-z0-9_.\-:/])(?P<name>[A-Za-z0-9_.\-]*" + _SECRET_WORD + r"[A-Za-z0-9_.\-]*)"
    r"(?:[\"'`\]]?[ \t]*(?::[ \t]*[A-Za-z_][\w.\[\], |]*?[ \t]*)?(?:=>|:=|(?<![=!<>])=(?!=)|:(?![:/]))"
    r"|(?P<comma>[\"'],[ \t]*)|(?P<flag>[ \t]+)(?=[\"']))[ \t]*"
    r"(?:(?P<q>[\"'`])(?P<qvalue>[^\"'`\n]{4,}?)(?P=q)|(?P<bvalue>[^\s\"'`,;#(){}\[\]<>][^\s\"'`,;(){}\[\]<>]{3,})(?=[\s,;#]|$))"
    r"|<(?P<tag>[\w:\-]*" + _SECRET_WORD + r"[\w:\-]*)>(?P<xvalue>[^<\s]{4,})</(?P=tag)>",
    re.MULTILINE,
)
_NOT_SECRET_NAME = re.compile(
    r"(?i)(?:^|[_.\-])(?:url|uri|file|files|path|dir|name|names|type|types|method|header|length|len|prefix|suffix|endpoint|mode|"
    r"field|env|var|format|fmt|regex|re|pattern|class|count|policy|prompt|label|help|hint|message|msg|expiry|expires|"
    r"ttl|timeout|scheme|provider|backend|kind|id|ids|index|idx|size|hash_name|location|source|required|enabled|"
    r"validator|strength|min|max|reset|changed|input|field_name)$"
    r"|tokeni[sz]|author(?!iz)|authori[tz]y|passe[ds]?$|passing|passage|passthrough|passive|compass|bypass|surpass"
)
_PLACEHOLDERS = {
    "password",
    "passwd",
    "secret",
    "changeme",
    "change_me",
    "token",
    "apikey",
    "api_key",
    "none",
    "null",
    "true",
    "false",
    "undefined",
    "redacted",
    "example",
    "xxx",
    "pass",
    "your_password",
    "yourpassword",
    "mypassword",
    "required",
    "optional",
    "string",
    "str",
    "bytes",
    "default",
    "empty",
    "dummy",
    "test",
}


def _entropy(value: str) -> float:
    counts = Counter(value)
    return -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())


def secret_shaped(value: str) -> bool:
    """Whether a value next to a secret-shaped name looks like a key or password rather than code, a template or
    a placeholder: no spaces, no template syntax, some digits, capitals or symbols, and not too few distinct
    characters."""
    from detect_secrets.filters.heuristic import is_sequential_string, is_templated_secret

    v = value.strip()
    if len(v) < 6 or " " in v or "REDACTED" in v or is_templated_secret(v) or is_sequential_string(v):
        return False
    if any(t in v for t in ("${", "{{", "{", "}", "%(", "%s", "$(", "<", ">", "***", "...", "\\", "os.environ", "getenv")):
        return False
    if v[0] == "$" or v.lower().strip("_-.") in _PLACEHOLDERS or re.fullmatch(r"(?i)(?:your|my|some|enter|insert)[_\- ]?\w*", v):
        return False
    if re.fullmatch(r"(.)\1+", v) or re.fullmatch(r"(?i)x+|\*+|-+|\.+", v):
        return False
    if re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", v) or re.fullmatch(r"[A-Za-z]+(?:[_\-.][A-Za-z]+)+", v):
        return False  # a dotted name (module.attr) or words joined by separators
    if re.fullmatch(r"[A-Za-z_][A-Za-z_]*", v) and not (re.search(r"[a-z][A-Z]|[A-Z][a-z].*[A-Z]", v) and len(v) >= 10):
        # letters only (an identifier or a word) unless mixed case and long
        return False
    if re.fullmatch(r"[a-z]+(?:[_\-][a-z]+)+", v) or re.fullmatch(r"[A-Z]+(?:_[A-Z]+)+", v):  # snake or kebab words
        return False
    if re.fullmatch(r"[\d.]+|\d+[smhd]?|v?\d+(?:\.\d+)*", v):  # numbers, durations, versions
        return False
    return _entropy(v) >= 2.3


@functools.cache
def _library_detectors() -> list[tuple[str, re.Pattern]]:
    """detect-secrets' token detectors (its regex-based plugins), each denylist pattern with the snake-case kind of
    its plugin; private keys, URL credentials and IP addresses are composer's patterns instead."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    from detect_secrets.plugins.base import RegexBasedDetector

    skip = {"Private Key", "Basic Auth Credentials", "Public IP (ipv4)"}
    out = []
    for secret_type, plugin in sorted(get_mapping_from_secret_type_to_class().items()):
        if issubclass(plugin, RegexBasedDetector) and secret_type not in skip:
            kind = re.sub(r"[^a-z0-9]+", "_", secret_type.lower()).strip("_")
            out += [(kind, pattern) for pattern in plugin.denylist]
    return out


def _library_spans(text: str) -> list[tuple[str, int, int]]:
    spans = []
    for kind, pattern in _library_detectors():
        for match in pattern.finditer(text):
            group = next((i for i in range(1, (pattern.groups or 0) + 1) if match.group(i)), 0)
            spans.append((kind, match.start(group), match.end(group)))
    return spans


def _assigned_spans(text: str) -> list[tuple[str, int, int]]:
    spans = []
    for match in ASSIGNED_SECRET.finditer(text):
        name = match.group("name") or match.group("tag")
        group = next(g for g in ("qvalue", "bvalue", "xvalue") if match.group(g) is not None)
        value = match.group(group)
        if _NOT_SECRET_NAME.search(name.strip("\"'`")) or not secret_shaped(value):
            continue
        before = text[max(0, match.start("name") - 24) : match.start("name")]
        if match.group("comma") and not re.search(r"\(\s*[\"']$", before):
            continue  # ("NAME", "value") only as a call's first two arguments: getenv, setdefault
        if match.group("flag") and not re.search(r"(?:^|\s)--?$", before):
            continue  # NAME "value" only as a command-line flag: --password "value"
        if group == "bvalue" and re.match(r"\s*\(", text[match.end(group) : match.end(group) + 3]):
            continue  # a call: password = make_password(...)
        spans.append(("assigned_secret", match.start(group), match.end(group)))
    return spans


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
        self.secrets = cleaning.redact_secrets
        if cleaning.redact_secrets:
            self.patterns += [(kind, re.compile(p), None) for kind, p in SECRET_PATTERNS.items()]
        if cleaning.redact_pii:
            self.pii = [("email", pii.emails_replacer.regex, None), ("ip_address", pii.ip_replacer.regex, public_ip_validator)]
        else:
            self.pii = []

    def spans(self, text: str) -> list[tuple[str, int, int]]:
        """(kind, start, end) of every secret and PII value in `text`, without overlaps (the first detector wins)."""
        candidates: list[tuple[str, int, int]] = []
        for kind, pattern, _ in self.patterns:
            for match in pattern.finditer(text):
                group = "value" if "value" in pattern.groupindex and match.group("value") is not None else 0
                candidates.append((kind, match.start(group), match.end(group)))
        if self.secrets:
            candidates += _library_spans(text) + _assigned_spans(text)
        for kind, pattern, valid in self.pii:
            candidates += [(kind, m.start(), m.end()) for m in pattern.finditer(text) if valid is None or valid(m.group(0))]
        taken: list[tuple[str, int, int]] = []
        for kind, start, end in candidates:
            if end > start and not any(s < end and start < e for _, s, e in taken):
                taken.append((kind, start, end))
        return sorted(taken, key=lambda span: span[1])

    def redact(self, text: str) -> tuple[str, list[tuple[str, int]]]:
        """The redacted text and (kind, line) of each replacement."""
        spans = self.spans(text)
        pieces, found, at = [], [], 0
        for kind, start, end in spans:
            pieces += [text[at:start], f"<REDACTED_{kind.upper()}>"]
            found.append((kind, text.count("\n", 0, start) + 1))
            at = end
        return "".join(pieces) + text[at:], found

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
