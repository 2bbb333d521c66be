"""Render the sbatch files from the recipes and templates; ``--check`` fails when sbatch/ drifts.

    python -m workflows.render            # rewrite sbatch/*.sbatch
    python -m workflows.render --check    # exit 1 with a unified diff when they differ (CI)
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from workflows import jobs, recipes, shell
from workflows.cli import OneLineParser
from workflows.jobs import Job, Knob
from workflows.recipes import Recipe

REPO = Path(__file__).resolve().parents[1]
SBATCH_DIR = REPO / "sbatch"
TEMPLATES = Path(__file__).resolve().parent / "templates"
HINT = "regenerate with python -m workflows.render"

Setting = tuple[Knob, object]


@dataclass(frozen=True)
class Settings:
    """A job's knob defaults arranged for the script: shared ones around a per-recipe case."""

    hoisted: list[Setting]
    """Same in every recipe and independent of per-recipe knobs: set before the case."""
    branches: list[tuple[str, list[Setting]]]
    """(MODEL/SIZE, the knobs whose default differs between recipes)."""
    trailing: list[Setting]
    """Same in every recipe but referring to a per-recipe knob: set after the case."""


def arrange(job: Job, recipe_list: list[Recipe]) -> Settings:
    """Split ``job``'s knobs so that each default is written once where it can, in a valid order."""
    per_recipe = [jobs.defaults(r) for r in recipe_list]
    varying = {k.env for k in job.knobs if len({repr(d[k.env]) for d in per_recipe}) > 1}
    hoisted: list[Setting] = []
    trailing: list[Setting] = []
    set_before_case = set(jobs.HEADER_VARIABLES)
    for knob in job.knobs:
        if knob.env in varying:
            continue
        value = per_recipe[0][knob.env]
        if isinstance(value, shell.Ref) and value.variable not in set_before_case:
            trailing.append((knob, value))
        else:
            hoisted.append((knob, value))
            set_before_case.add(knob.env)
    branches = [
        (r.key, [(k, d[k.env]) for k in job.knobs if k.env in varying])
        for r, d in zip(recipe_list, per_recipe, strict=True)
    ]
    settings = Settings(hoisted, branches, trailing)
    _check_references(job, settings)
    return settings


def _check_references(job: Job, settings: Settings) -> None:
    """Every Ref must name a variable the script has assigned by the time it reads it."""
    for _key, branch in settings.branches:
        assigned = set(jobs.HEADER_VARIABLES)
        for knob, value in [*settings.hoisted, *branch, *settings.trailing]:
            if isinstance(value, shell.Ref) and value.variable not in assigned:
                raise ValueError(
                    f"{job.filename}: {knob.env} refers to ${value.variable} before it is set; "
                    "reorder the knobs in workflows/jobs.py"
                )
            assigned.add(knob.env)


def _assign(variable: object, default: object) -> shell.ShellWord:
    """Filter ``assign``: ``NAME=${NAME:-default}``, the override-with-default idiom."""
    var = shell.name(variable)
    return shell.ShellWord(f"{var}=${{{var}:-{shell.quote(default)}}}")


def _comment(text: object) -> shell.ShellWord:
    """Filter ``comment``: text for a ``#`` line; a newline would end the comment, so refuse it."""
    if not isinstance(text, str) or any(ch in text for ch in "\r\n\0"):
        raise ValueError(f"comment text must be one line: {text!r}")
    return shell.ShellWord(text)


def _only_quoted(value: object) -> object:
    """Jinja ``finalize``: an interpolation that skipped the quoting filters fails the render."""
    if not isinstance(value, shell.ShellWord):
        raise TypeError(f"template interpolates {value!r} without the q/name/assign/comment filter")
    return value


def _strict(filter_function):
    """Filters receive Undefined values before StrictUndefined can object: make them object."""

    def checked(value, *args):
        if isinstance(value, jinja2.Undefined):
            value._fail_with_undefined_error()
        return filter_function(value, *args)

    return checked


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        finalize=_only_quoted,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,  # shell, not HTML: quoting is the filters' job
    )
    filters = {"q": shell.quote, "name": shell.name, "assign": _assign, "comment": _comment, "fmt": shell.template}
    env.filters.update({key: _strict(f) for key, f in filters.items()})
    return env


def render_job(job: Job, recipe_list: list[Recipe] | None = None) -> str:
    """The text of ``job``'s sbatch file; the first recipe supplies the defaults for MODEL/SIZE."""
    recipe_list = recipe_list or recipes.all_recipes()
    per_recipe = [jobs.defaults(r) for r in recipe_list]
    optional = {k.env for k in job.knobs if any(d[k.env] is None for d in per_recipe)}
    template = environment().get_template(f"{job.filename}.j2")
    return template.render(
        job=job,
        default=recipe_list[0],
        section=arrange(job, recipe_list),
        optional=optional,
        recipe_keys=" ".join(r.key for r in recipe_list),
        aliases=list(jobs.ALIASES.items()),
        transports=jobs.TRANSPORTS,
        default_output_dir=jobs.DEFAULT_OUTPUT_DIR,
    )


def render_all() -> dict[str, str]:
    """File name under sbatch/ -> rendered text, for every job of the chain."""
    return {job.filename: render_job(job) for job in jobs.JOBS}


def drift(rendered: dict[str, str], directory: Path) -> list[str]:
    """Unified-diff lines between ``directory``'s files and the render (empty: identical)."""
    lines: list[str] = []
    for filename, text in rendered.items():
        path = directory / filename
        current = path.read_text() if path.is_file() else ""
        if current != text:
            lines += difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{path} (committed)", tofile=f"{path} (rendered)",
            )
    return lines


def write(rendered: dict[str, str], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, text in rendered.items():
        path = directory / filename
        path.write_text(text)
        path.chmod(0o755)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m workflows.render", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on drift")
    parser.add_argument("--output-dir", type=Path, default=SBATCH_DIR, help="default: sbatch/")
    args = parser.parse_args(argv)
    rendered = render_all()
    if args.check:
        diff = drift(rendered, args.output_dir)
        if diff:
            sys.stdout.writelines(diff)
            print(f"\n{args.output_dir} differs from the templates: {HINT}", file=sys.stderr)
            return 1
        print(f"{args.output_dir}: {len(rendered)} sbatch files match the templates")
        return 0
    for path in write(rendered, args.output_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
