"""The ``dsakit`` command: a thin layer over the public API."""

from __future__ import annotations

import platform

import typer

app = typer.Typer(help="dsakit: DeepSeek Sparse Attention made fast, memory-safe and trustworthy at long context.",
                  no_args_is_help=True, add_completion=False)


@app.callback()
def _root() -> None:
    """dsakit: DeepSeek Sparse Attention made fast, memory-safe and trustworthy at long context."""


@app.command()
def env() -> None:
    """Versions of Python, torch, triton and dsakit, and the GPU if any."""
    import torch

    import dsakit
    from dsakit.ops._backend import triton_available

    lines = [("dsakit", dsakit.__version__), ("python", platform.python_version()), ("platform", platform.platform()),
             ("torch", torch.__version__)]
    if triton_available():
        import triton

        lines.append(("triton", triton.__version__))
    else:
        lines.append(("triton", "not installed"))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(("gpu", f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
                             f"{props.multi_processor_count} SMs)"))
        lines.append(("cuda", str(torch.version.cuda)))
    else:
        lines.append(("gpu", "none (CPU only: reference backend, Triton kernels via TRITON_INTERPRET=1)"))
    for key, value in lines:
        typer.echo(f"{key:<9} {value}")


# Subcommands that live in their own packages.
from .niah.cli import niah  # noqa: E402
from .recall.cli import recall  # noqa: E402
from .models.train import TRAIN_COMMAND_CONTEXT, train_command  # noqa: E402
from .serve.model import serve_command  # noqa: E402
from .serve.reference import serve_reference_command  # noqa: E402

app.command("recall")(recall)
app.command("niah")(niah)
app.command("serve-reference")(serve_reference_command)
app.command("serve")(serve_command)
app.command("train", context_settings=TRAIN_COMMAND_CONTEXT, add_help_option=False)(train_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
