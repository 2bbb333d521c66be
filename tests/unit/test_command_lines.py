"""Every command line parses through the one parser class, trainer.cli.OneLineParser: bad
input is one stderr line ``<prog>: error: ...`` naming the program, exit status 2, and ``main(argv)``
returns the int the ``__main__`` block exits with. A new ``main`` on a raw argparse parser fails here."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from trainer.cli import EXIT_BAD_INPUT, OneLineParser

REPO = Path(__file__).resolve().parents[2]
# scripts/device/ holds the device tool's throwaway drivers of one measurement each (fixed arguments).
SOURCES = [*sorted((REPO / "trainer").rglob("*.py")), *sorted((REPO / "workflows").rglob("*.py")),
           *sorted((REPO / "datasets").glob("*.py")), *sorted((REPO / "scripts").glob("*.py"))]
# Their flags are trainer.config's (build_parser, a OneLineParser), parsed by parse_config with
# parse_known_args: unknown flags join every other configuration problem in one ConfigError, printed
# as ``error: ...`` with exit status 2 (tests/unit/test_config.py).
CONFIG_PARSED = {"trainer.train", "trainer.bench.direct"}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _has_main(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


MAINS = [_module_name(p) for p in SOURCES if _has_main(_parsed(p))]


def _import(name: str) -> ModuleType:
    if name.split(".")[0] in ("trainer", "workflows"):
        return importlib.import_module(name)
    # datasets/ and scripts/ are folders of scripts, not packages: load the file under its own name.
    spec = importlib.util.spec_from_file_location(f"_cli_{name.replace('.', '_')}", REPO / f"{name.replace('.', '/')}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_mains_were_found():
    assert len(MAINS) >= 14, MAINS
    assert {"trainer.schedule.simulate", "workflows.submit", "datasets.build_corpus"} <= set(MAINS)


def test_no_raw_argparse_parser_outside_the_shared_class():
    offenders = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in SOURCES if path != REPO / "trainer" / "cli.py"
        for node in ast.walk(_parsed(path))
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "ArgumentParser"
    ]
    assert not offenders, f"build command lines with trainer.cli.OneLineParser: {offenders}"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.parts[len(REPO.parts)] in ("datasets", "scripts")],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_scripts_exit_with_the_int_their_main_returns(path):
    """What tests/unit/test_house_style.py holds trainer/ and workflows/ to, for datasets/ and scripts/."""
    tree = _parsed(path)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    guard = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'")
    assert ast.unparse(main.returns) == "int" and ast.unparse(main.args) == "argv: list[str] | None=None"
    assert ast.unparse(guard.body[-1]) == "sys.exit(main())"


@pytest.mark.parametrize("name", sorted(set(MAINS) - CONFIG_PARSED))
def test_a_bad_flag_is_one_line_naming_the_program_and_exit_2(name, capsys):
    module = _import(name)
    with pytest.raises(SystemExit) as info:
        module.main(["--bogus-flag"])
    assert info.value.code == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], captured.err
    prog = lines[0].split(": error: ")[0]
    assert prog.startswith("python") and name.split(".")[-1] in prog, prog  # e.g. python -m trainer.preprocess
    assert "usage:" not in captured.err and captured.out == ""


@pytest.mark.parametrize("name", sorted(CONFIG_PARSED))
def test_the_trainers_command_lines_parse_through_the_config_parser(name):
    import trainer.config

    assert isinstance(trainer.config.build_parser(), OneLineParser)
    source = (REPO / f"{name.replace('.', '/')}.py").read_text()
    assert "parse_config(argv" in source, f"{name}: its flags are trainer.config's"


def test_a_bad_value_names_the_program_the_flag_and_the_value(capsys):
    parser = OneLineParser(prog="python -m some.tool")
    parser.add_argument("--calls", type=int, default=1)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--calls", "many"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "python -m some.tool: error: argument --calls: invalid int value: 'many'\n"
    assert parser.report("--calls=0 must be >= 1") == 2
    assert capsys.readouterr().err == "python -m some.tool: error: --calls=0 must be >= 1\n"


def test_subcommands_are_of_the_shared_class_too(capsys):
    parser = OneLineParser(prog="python -m some.tool")
    parser.add_subparsers(dest="command", required=True).add_parser("run").add_argument("--n", type=int)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["run", "--n", "x"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "python -m some.tool run: error: argument --n: invalid int value: 'x'\n"


def test_the_parser_needs_a_program_name():
    with pytest.raises(TypeError):
        OneLineParser()  # type: ignore[call-arg]
    assert issubclass(OneLineParser, argparse.ArgumentParser) and "trainer.cli" in sys.modules
