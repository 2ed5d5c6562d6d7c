"""Which transport reaches which engines: `transport=` resolved against where each engine runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from ..errors import ValidationError
from .base import Transport, transport_class, transport_for, transport_names

if TYPE_CHECKING:
    from ..engines.base import Engine
    from .collective import CollectiveTransport


def choose_transport(arg: str | Transport, engines: Sequence[Engine]) -> Transport:
    """The transport `arg` names (an instance is taken as it is); for "auto", by placement, through the transport
    registry: engines on this host get the one that reaches their device kind, engines elsewhere
    (`Engine.remote`) the one that reaches remote engines, rendezvous on the address they give
    (`Engine.rendezvous_addr`); both kinds at once get a `MixedTransport`."""
    from .mixed import MixedTransport  # imports the collective transport (torch.distributed), only when mixed

    if isinstance(arg, Transport):
        return arg
    addr = next((e.rendezvous_addr for e in engines if e.rendezvous_addr), None)

    def remote(name: str | None = None) -> Transport:
        cls = transport_class(name or transport_for("remote"))
        return cls(master_addr=addr) if addr and cls.rendezvous else cls()  # type: ignore[call-arg]

    if arg != "auto":
        return remote(arg) if transport_class(arg).reaches == "remote" else transport_class(arg)()
    near = [e for e in engines if not e.remote]
    far = [e for e in engines if e.remote]
    if not far:
        return transport_class(transport_for(local_kind(near)))()
    lost = [e.name for e in far if not e.rendezvous_addr]
    if lost:
        raise ValidationError(f"engines {lost} run on another host but give no address of this one to meet at: "
                              "pass transport=CollectiveTransport(master_addr=<this host's address>)")
    if not near:
        return remote()
    far_transport = remote()
    if not far_transport.pairs_with_local:
        pairing = [n for n in transport_names() if transport_class(n).pairs_with_local]
        raise ValidationError(f"engines here and elsewhere at once need a transport for the others that pairs "
                              f"with a local one ({pairing}), not {far_transport.name!r}")
    return MixedTransport(transport_class(transport_for(local_kind(near)))(),
                          cast("CollectiveTransport", far_transport))


def local_kind(engines: Sequence[Engine]) -> str:
    """"cpu" or "cuda": the device kind every engine on this host runs on."""
    kinds = {e.device.split(":")[0] for e in engines}
    if kinds <= {"cpu"}:
        return "cpu"
    if kinds <= {"cuda"}:
        return "cuda"
    raise ValidationError(f"cannot choose a transport for engines on {sorted(kinds)}: pass transport=")
