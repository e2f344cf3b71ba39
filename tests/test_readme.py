"""The README says what the code does: its first two commands set up and run the quickstart and the tests; CI runs
that test command verbatim (a skip outside the GPU module fails it there), and it collects tests/ only; its file map
is the files on disk; it stays short (the long sections are pages under docs/) and every link in it and in docs/
leads somewhere. docs/training.md's key list is Config's, section by section."""
import configparser
import dataclasses
import os
import re
import subprocess
import sys
import textwrap

from gpt2train.config import Config, config_sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def readme_keys():
    """{section title: [keys]} from docs/training.md's bullet list under 'Keys, in the sections of `Config`'."""
    text = read(os.path.join("docs", "training.md"))
    first = text.index("\n- **", text.index("Keys, in the sections of `Config`"))
    block = text[first + 1:text.index("\n\n", first)]
    sections, title = {}, None
    for line in block.splitlines():
        m = re.match(r"- \*\*(.+?)\*\*: (.*)", line)
        if m:
            title, line = m.groups()
            sections[title] = []
        sections[title] += re.findall(r"`(\w+)`", line)
    return sections


def test_readme_key_list_is_configs():
    readme = readme_keys()
    config = {re.split(r":| \(", title)[0]: names for title, names in config_sections()[0]}
    fields = [f.name for f in dataclasses.fields(Config)]
    listed = [k for keys in readme.values() for k in keys]
    assert sorted(listed) == sorted(set(listed)), "a key is listed twice in docs/training.md"
    missing, unknown = set(fields) - set(listed), set(listed) - set(fields)
    assert not missing and not unknown, \
        f"docs/training.md keys: missing {sorted(missing)}, not in Config {sorted(unknown)}"
    assert readme == config  # the same sections, the same keys in each, in Config's order


def test_first_two_commands_set_up_and_run():
    text = read("README.md")
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)  # the first code block
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["pip install -r requirements.txt && python train_gpt2.py configs/quickstart.py",
                        "pip install -r requirements-dev.txt && python -m pytest -q"]
    assert "-r requirements.txt" in read("requirements-dev.txt").splitlines()  # the second installs everything
    ci = [line for line in read(".ci/run").splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-1] == commands[1]  # CI runs the README's test command, verbatim


def test_pytest_collects_tests_only():
    ini = configparser.ConfigParser()
    ini.read(os.path.join(ROOT, "pytest.ini"))
    assert ini["pytest"]["testpaths"].split() == ["tests"]


def inner_pytest(folder, env):
    """pytest over folder in a process of its own (rootdir: folder), ended by pid whatever happens: (exit code,
    output)."""
    from conftest import end_processes
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir",
                          str(folder), str(folder)], cwd=folder, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            end_processes([p.pid])
            p.wait()
    return p.returncode, out


def test_ci_fails_on_a_skip_outside_the_gpu_module(tmp_path):
    """An importorskip whose package failed to install is a skip, not a failure: pytest.ini lists skips (-rfEs) and
    .ci/run sets CI_NO_SKIPS=1, under which conftest.py fails the run on a skip outside test_cuda.py (no GPU).
    In pytests of their own with the real conftest.py: CI_NO_SKIPS=1 fails on a missing package's skip, naming
    it alone (not test_cuda.py's skip, nor an xfail); without it, the same skips pass, listed."""
    ini = configparser.ConfigParser()
    ini.read(os.path.join(ROOT, "pytest.ini"))
    assert "s" in re.search(r"-r(\w+)", ini["pytest"]["addopts"]).group(1)
    ci = [line.strip() for line in read(".ci/run").splitlines()]
    assert ci.index("export CI_NO_SKIPS=1") < len(ci) - 1  # before the README's test command, the last line
    with open(os.path.join(ROOT, "tests", "conftest.py")) as f:  # the real one, with the repository importable
        (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + f.read())
    (tmp_path / "test_cuda.py").write_text("import pytest\npytest.skip('no CUDA GPU here', allow_module_level=True)\n")
    (tmp_path / "test_other.py").write_text(textwrap.dedent("""
        import pytest

        def test_passes():
            pass

        @pytest.mark.xfail(strict=True)
        def test_xfails():
            assert False

        def test_needs_a_package():
            pytest.importorskip("a_package_that_did_not_install")
    """))
    env = {k: v for k, v in os.environ.items() if k != "CI_NO_SKIPS"}
    code, out = inner_pytest(tmp_path, dict(env, CI_NO_SKIPS="1"))
    assert code == 1 and "1 passed, 2 skipped, 1 xfailed" in out, out
    assert "error: 1 skipped outside the GPU module (test_cuda.py)" in out, out
    assert "  skipped: test_other.py::test_needs_a_package" in out and "skipped: test_cuda.py" not in out, out
    code, out = inner_pytest(tmp_path, env)
    assert code == 0 and "SKIPPED [1] test_other.py" in out and "1 passed, 2 skipped, 1 xfailed" in out, out
    assert "error" not in out, out


# -----------------------------------------------------------------------------
# the README is a first screen and a tour; the long sections are pages under docs/

README_MAX_BYTES = 20 * 1024  # issue 30: the whole README


def test_readme_is_short():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move a long section to a page under docs/"


def slug(heading):
    """GitHub's anchor for a markdown heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    """The anchors GitHub gives a page's headings (a repeated one gets -1, -2, ...)."""
    seen = {}
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        yield base if n == 0 else f"{base}-{n}"


def markdown_pages():
    return ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                            if f.endswith(".md")]


def test_every_link_leads_somewhere():
    """Every relative link of the README and of docs/*.md names a file that exists, and its #anchor (if any) a
    heading of that page: a page moved or a heading renamed breaks a test, not a reader's click."""
    broken, readme_docs = [], set()
    for page in markdown_pages():
        text = read(page)
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if page == "README.md" and file.startswith("docs" + os.sep):
                readme_docs.add(file)
            if not os.path.exists(os.path.join(ROOT, file)):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and (not file.endswith(".md") or anchor not in set(anchors(read(file)))):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken
    pages = {p for p in markdown_pages() if p != "README.md"}
    assert pages and readme_docs == pages, f"docs pages the README does not link: {sorted(pages - readme_docs)}"


def file_map():
    """The first column of the README's tour table: the files and folders it names."""
    text = read("README.md")
    table = text[text.index("| file | what it is for |"):]
    table = table[:table.index("\n\n")]
    return [p for row in table.splitlines()[2:] for p in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def python_files(folder):
    return sorted(os.path.join(folder, f) if folder != "." else f for f in os.listdir(os.path.join(ROOT, folder))
                  if f.endswith(".py") and f != "__init__.py")


def test_file_map_is_the_files_on_disk():
    """The tour's table names files that exist, and every Python file of the root (the eight commands) and of the
    gpt2train/ package is in it: a module added, moved or removed must be told in the README."""
    listed = file_map()
    missing = [p for p in listed if not os.path.exists(os.path.join(ROOT, p.rstrip("/")))]
    assert not missing, f"the README's file map names files that do not exist: {missing}"
    commands = ["bench.py", "export.py", "fineweb.py", "hellaswag.py", "model.py", "plot.py", "sample.py",
                "train_gpt2.py"]
    assert python_files(".") == commands  # the root holds the eight commands only (issues 30, 38)
    unlisted = [p for p in python_files(".") + python_files("gpt2train") if p not in listed]
    assert not unlisted, f"Python files the README's file map does not name: {unlisted}"


def test_commands_in_the_docs_name_files_that_exist():
    """Every `python X.py` / `torchrun ... X.py` line in a code block of the README or docs/ runs a script that is
    there (a benchmark that moved to dev/, say)."""
    missing = []
    for page in markdown_pages():
        for block in re.findall(r"```(?:bash|python)?\n(.*?)```", read(page), re.S):
            for line in block.splitlines():
                line = line.split("  #")[0]
                if re.match(r"\s*(#|$)", line):
                    continue
                for script in re.findall(r"(?:python3?|torchrun\b[^#]*?)\s+([\w/.-]+\.py)\b", line):
                    if not os.path.exists(os.path.join(ROOT, script)):
                        missing.append(f"{page}: {script}")
    assert not missing, missing
