"""`kvstore bench ...`: each benchmark lives in its own module and adds one subcommand.

Subcommands are imported lazily, so `kvstore --help` stays fast and a benchmark's
optional dependencies (matplotlib, redis, mooncake) load only when it runs.
"""

from __future__ import annotations

import importlib

import click

# subcommand name -> "module:attribute" of a click.Command
SUBCOMMANDS: dict[str, str] = {
    "synth": "kvstore_bench.synth_cli:synth_cmd",
    "replay": "kvstore_bench.replay.cli:replay_cmd",
    "scale": "kvstore_bench.scale.cli:scale_cmd",
    "store": "kvstore_bench.transfer.store:store_cmd",
    "transfer": "kvstore_bench.transfer.run:transfer_cmd",
    "contention": "kvstore_bench.contention:contention_cmd",
    "engine": "kvstore_bench.engine.cli:engine_cmd",
    "engine-groups": "kvstore_bench.engine.groups:engine_groups_cmd",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            cmd = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            reason = f"benchmark {cmd_name!r} is not available: {e}"

            def unavailable() -> None:
                raise click.ClickException(reason)

            return click.Command(cmd_name, callback=unavailable, help=f"(unavailable: {e})")
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=LazyGroup)
def bench() -> None:
    """Benchmarks: results go to bench/results/ as JSON and PNG."""
