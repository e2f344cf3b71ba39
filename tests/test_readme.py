"""The README says what the code does: its key list is Config's, section by section; its first two
commands set up and run the quickstart and the tests; CI runs that test command verbatim, and it
collects tests/ only."""
import configparser
import dataclasses
import os
import re

from gpt2train.config import Config, config_sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def readme_keys():
    """{section title: [keys]} from the README's bullet list under 'Keys, in the sections of `Config`'."""
    text = read("README.md")
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
    assert sorted(listed) == sorted(set(listed)), "a key is listed twice in the README"
    missing, unknown = set(fields) - set(listed), set(listed) - set(fields)
    assert not missing and not unknown, f"README keys: missing {sorted(missing)}, not in Config {sorted(unknown)}"
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
