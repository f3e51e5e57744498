"""The one dispatcher every entry point goes through: a prepared call, run as its entry of the table of modes says.

    the public ops (op.py: mamba-ssm's argument list)   the adapters (integrations.core.mixer_forward)
        -> call.prepare   the arguments as one MixerCall, checked alike on every rank
        -> run(call)      the call's entry of the table of modes (modes.py) says what runs:
                              the entry's move, zigzag -> contiguous   (permute.move_in; permute_* entries)
                              in_proj, when the call carries projections
                              the strategy, autocast off:  group of one   strategies/group_of_one.run   (cp == 1)
                                                           state passing  strategies/state_passing.run
                                                           ulysses        strategies/ulysses.run
                                  forward_only (inference): the same entry's forward-only route, no_grad:
                                                           group of one   group_of_one.run_forward_only
                                                           state passing  state_passing.run_forward_only
                                                           ulysses        ulysses.run_forward_only
                              out_proj; the move back                  (permute.move_out)

The strategies import nothing above them; this module is the only one that knows them all. See
docs/design.md, "One dispatch path".
"""

from __future__ import annotations

import torch

from ds_mamba_spcp.engine import graphs, modes, permute
from ds_mamba_spcp.engine.call import MixerCall
from ds_mamba_spcp.engine.strategies import group_of_one, state_passing, ulysses

STRATEGIES = {modes.STATE_PASSING: state_passing.run, modes.ULYSSES: ulysses.run}
# the forward-only routes (Options.forward_only; docs/design.md, "Forward only")
FORWARD_ONLY = {modes.STATE_PASSING: state_passing.run_forward_only, modes.ULYSSES: ulysses.run_forward_only}


def run(call: MixerCall):
    """Runs a prepared call as its entry of the table of modes says. Autocast does not reach the core: it
    computes as its inputs' dtypes say, with every cross-rank quantity in fp32 (as mamba-ssm's op); the
    projections of an adapter's call run under the caller's autocast, as the host mixer's own do."""
    move = call.entry.move if call.cp > 1 else None
    if move is not None:
        call = permute.move_in(call, move)
    projections = call.projections
    if projections is not None:
        call = call.replace(zxbcdt=projections.in_proj(projections.hidden), projections=None)
    if call.options.forward_only:
        strategy = group_of_one.run_forward_only if call.cp == 1 else FORWARD_ONLY[call.entry.strategy]
    else:
        strategy = group_of_one.run if call.cp == 1 else STRATEGIES[call.entry.strategy]
    with torch.autocast(device_type=call.zxbcdt.device.type, enabled=False):
        graphed = call.options.cuda_graphs and not call.options.forward_only  # inference runs eager: no backward
        res = graphs.run(call, strategy) if graphed else strategy(call)
    out, final_states = res if call.options.return_final_states else (res, None)
    if projections is not None:
        out = projections.out_proj(out)
    if move is not None:
        out = permute.move_out(out, call.group, move)
    return (out, final_states) if call.options.return_final_states else out
