"""Daemon identities: the incarnation token each `register` issues, and who may use or claim
an identity with it. Sans-IO.

A process holds a daemon identity (kind, id) by the token of its incarnation; only a hash of
each token is kept (and persisted). A live identity (heard within the dead window) goes only to
the process presenting its token, or to its own address (a retried register, or a restart on
the same host and port); refusals repeat every retry, so they are logged once a minute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import TYPE_CHECKING

from kera.daemon.repeat_log import RepeatedWarnings
from kera.errors import IdInUse, NotReady

if TYPE_CHECKING:
    from kera.coordinator.core import Member

log = logging.getLogger(__name__)


def token_sha256(token: str) -> str:
    """The kept form of an incarnation token."""
    return hashlib.sha256(token.encode()).hexdigest()


class Identities:
    """Checks tokens against the member tables (the coordinator's, shared)."""

    def __init__(self, members: dict, dead_after_s: float, started_s: float):
        """`members`: {kind: {id: Member}}; `started_s`: when this coordinator started (a token
        holder not heard since counts as live for a dead window)."""
        self.members = members
        self.dead_after_s = dead_after_s
        self.started_s = started_s
        self.refusals = RepeatedWarnings()

    def check_claim(self, member: "Member", token: str | None, address: str,
                    now: float) -> None:
        """IdInUse unless the process at `address` (with `token`) may take `member`'s identity."""
        if not self._may_claim(member, token, address, now):
            self._refuse_claim(member, address, now)

    def authenticate(self, kind: str, member_id: int, token: str | None,
                     now: float) -> "Member":
        """The member, if `token` is its current incarnation's; raises otherwise."""
        member = self.members[kind].get(member_id)
        if member is None:
            raise NotReady(f"unknown {kind} id {member_id}: register first")
        if member.token_sha256 is None:
            raise NotReady(f"{kind} {member_id} has no incarnation token yet: register again")
        if token is None or not hmac.compare_digest(token_sha256(token), member.token_sha256):
            dropped = self.refusals.admit(("token", kind, member_id, member.address), now)
            if dropped is not None:
                log.warning("%s %d: refused a request without the token of its incarnation "
                            "registered at %s%s", kind, member_id, member.address,
                            self.refusals.note(dropped))
            raise IdInUse(f"{kind} id {member_id} belongs to another incarnation (registered at "
                          f"{member.address}); this process no longer holds it: stop it, or "
                          f"restart it with another --id")
        return member

    def _holder_live(self, member: "Member", now: float) -> bool:
        """Is a process holding this identity heard from within the dead window? Right after a
        coordinator restart every holder of a token counts as live until it had time to beat."""
        if member.token_sha256 is None:
            return False
        heard = member.last_heartbeat_s
        if heard is None:
            return now - self.started_s <= self.dead_after_s
        return now - heard <= self.dead_after_s

    def _may_claim(self, member: "Member", token: str | None, address: str, now: float) -> bool:
        if not self._holder_live(member, now):
            return True   # an ordinary restart: the previous holder is gone
        if address == member.address:
            # The live holder's own address: no second process can bind it while the holder
            # runs, so this is the holder again (a register retried after a lost reply) or
            # its restart on the same host and port, without the token of a data directory.
            return True
        return token is not None and hmac.compare_digest(token_sha256(token), member.token_sha256)

    def _refuse_claim(self, member: "Member", address: str, now: float) -> None:
        dropped = self.refusals.admit(("claim", member.kind, member.id, address), now)
        if dropped is not None:
            log.warning("%s id %d is live at %s: refused it to a second process at %s (which "
                        "did not present the live incarnation's token)%s", member.kind,
                        member.id, member.address, address, self.refusals.note(dropped))
        raise IdInUse(f"{member.kind} id {member.id} is in use by a live {member.kind} at "
                      f"{member.address}: start this process with another --id, or stop the "
                      f"other process first (its id is free {self.dead_after_s:g} s after it "
                      f"stops)")
