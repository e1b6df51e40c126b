"""`guardrails demo`: guard injected bad logits at two sites and print flags and counts."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "demo", help="guard injected bad logits and print flags and counts"
    )
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import guardrails as gr
    from guardrails.testing import inject_

    guards = gr.Guardrails()
    logits_site = guards.site("sampler.logits")
    ids_site = guards.token_site("sampler.token_ids", vocab_size=args.vocab)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=generator).to(torch.float16)
    inject_(logits, rows=[1], kind="nan", count=3, generator=generator)
    inject_(logits, rows=[2], kind="posinf", count=2, generator=generator)
    inject_(logits, rows=[3], kind="nan", count="all")
    flags = logits_site(logits)
    ids = torch.multinomial(torch.softmax(logits.float(), -1), 1).squeeze(1)
    ids[0] = args.vocab + 7  # a faulty sampler
    id_flags = ids_site(ids)
    print(f"logits flags   {_show(flags)}")
    print(f"token id flags {_show(id_flags)}")
    print(f"{'site':<20} {'kind':<22} count")
    for (site, kind), value in sorted(guards.counts().items()):
        print(f"{site:<20} {kind:<22} {value}")
    guards.close()
    return 0


def _show(flags: Any) -> str:
    import guardrails as gr

    if flags is None:
        return "(site disabled)"
    return ", ".join(gr.RowFlag(v).name or "0" if v else "0" for v in flags.tolist())
