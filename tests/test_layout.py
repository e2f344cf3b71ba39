"""The house's shape (issue 30): the commands at the root, the parts in gpt2train/, the imports pointing down only.
Read from the source with ast (imports inside functions count too), so a lazy import cannot hide an arrow."""
import ast
import glob
import os

from conftest import ROOT

COMMANDS = {"train_gpt2", "model", "export", "fineweb", "hellaswag", "sample", "plot", "bench"}


def modules():
    """{module name: path}: root scripts by name ("model"), package modules dotted ("gpt2train.optim")."""
    out = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}
    for p in glob.glob(os.path.join(ROOT, "gpt2train", "*.py")):
        name = os.path.basename(p)[:-3]
        if name != "__init__":
            out[f"gpt2train.{name}"] = p
    return out


def imports(path, mods):
    """The project modules path imports, by the names of modules()."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"gpt2train.{node.module}"
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # from . import x
            names = [f"gpt2train.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in mods}
    return found


def graph():
    mods = modules()
    return {m: imports(p, mods) - {m} for m, p in mods.items()}


def test_the_root_holds_the_eight_commands():
    assert {m for m in modules() if "." not in m} == COMMANDS


def test_no_package_module_imports_a_root_script():
    upward = sorted(f"{m} -> {d}" for m, deps in graph().items() if m.startswith("gpt2train.")
                    for d in deps if "." not in d)
    assert upward == []


def test_no_import_cycle():
    g, state, cycles = graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"
    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []
    assert "gpt2train.loss" in g["model"] and "model" not in g["gpt2train.memory"]  # the graph is read at all


def test_the_checker_sees_an_upward_arrow(tmp_path):
    """The reader finds `from model import X` inside a function (a lazy import is an arrow too)."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from model import GPT\n    from gpt2train import optim\n")
    assert imports(str(p), modules()) == {"model", "gpt2train.optim"}


def test_bench_is_the_command_over_its_tools():
    """bench.py is the benchmark command (flags, header, the GPT it times, dispatch); each tool is a package module
    it imports (issue 45), which gets model.py's GPT from bench.py, never by importing it."""
    g = graph()
    tools = {"gpt2train.ladder", "gpt2train.ddp_bench", "gpt2train.memory_report"}
    assert tools <= g["bench"] and "model" in g["bench"]
    assert not any("model" in g[t] or "bench" in g[t] for t in tools)


def test_the_micro_batch_finder_is_a_room_over_the_byte_counts():
    """memory.py counts a step's bytes and picks the loss head that fits; the finder (microbatch.py: fit, probe,
    THE micro-batch of a run) is a module of its own over it (issue 45): it imports memory, never the reverse."""
    g, mods = graph(), modules()
    assert "gpt2train.memory" in g["gpt2train.microbatch"]
    assert not {"gpt2train.microbatch", "gpt2train.optim"} & g["gpt2train.memory"]
    defined = {m: {n.name for n in ast.parse(open(mods[m]).read()).body if isinstance(n, ast.FunctionDef)}
               for m in ("gpt2train.memory", "gpt2train.microbatch")}
    finder = {"choose_micro_batch", "auto_micro_batch", "search_micro_batch", "fit_micro_batch", "probe_steps"}
    assert finder <= defined["gpt2train.microbatch"] and not finder & defined["gpt2train.memory"]
    assert {"training_bytes_estimate", "use_loss_head"} <= defined["gpt2train.memory"]
