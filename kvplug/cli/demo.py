"""``kvplug demo``: a small seeded chat workload through kvplug's own cache."""

from __future__ import annotations

import click

from kvplug.tools.demo import chat_workload, run_demo


@click.command()
@click.option("--block-size", default=16, show_default=True)
@click.option("--capacities", default="128,512,2048", show_default=True, help="Pool sizes, blocks.")
@click.option("--seed", default=0, show_default=True)
def demo(block_size: int, capacities: str, seed: int) -> None:
    """Run a seeded chat workload through kvplug's cache at a few capacities."""
    workload = chat_workload(seed=seed)
    prompt_tokens = sum(len(t.prompt) for t in workload)
    click.echo(
        f"{len(workload)} turns, {prompt_tokens:,} prompt tokens, block size {block_size}, "
        "policy lru\n"
    )
    header = f"{'capacity':>9} {'hit ratio':>9} {'matched':>9} {'evictions':>9} {'CoW':>5} "
    header += f"{'release p99':>11} {'peak waste':>10}"
    click.echo(header)
    for capacity in (int(c) for c in capacities.split(",")):
        r = run_demo(capacity, block_size, workload)
        click.echo(
            f"{r['capacity_blocks']:>9} {r['token_hit_ratio']:>9.3f} {r['matched_tokens']:>9,} "
            f"{r['evictions']:>9,} {r['cow_copies']:>5} {r['release_age_p99']:>11} "
            f"{r['peak_tail_waste']:>10}"
        )
