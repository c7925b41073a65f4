"""What a ModelDeployment's pods report about themselves: ready, or failing and why.

A Deployment's own status says how many pods are ready, not why the others are not; a
container that exits at once (a refused flag: exit 2) leaves the Deployment "progressing"
until its deadline, 40 minutes later. The pods say it at once: a container waiting in
``CrashLoopBackOff`` (or an image or configuration error), or restarted after a failed
exit, or a pod the scheduler cannot place (``Unschedulable``: no node has the resources,
selector or tolerations it asks for), is failing, with the kubelet's or the scheduler's
reason and message and the container's last words
(the operator renders ``terminationMessagePolicy: FallbackToLogsOnError``, so a container
that wrote no termination message leaves the tail of its log there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import names

# Waiting reasons of a container that will not run without a change (kubelet's names).
FAILING_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
MESSAGE_LIMIT = 600  # characters of a container's last words kept in a condition


@dataclass(frozen=True)
class PodReport:
    """One pod of a component: whether it is Ready, and why it fails when it does."""

    name: str
    component: str
    ready: bool
    failure_reason: str | None = None  # e.g. CrashLoopBackOff
    failure_message: str = ""

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodReport:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        conditions = status.get("conditions") or ()
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        reason, message = None, ""
        if status.get("phase") == "Failed":
            reason = str(status.get("reason") or "PodFailed")
            message = str(status.get("message") or "")
        for c in conditions:  # the scheduler found no node for it (a spec no node can host)
            unschedulable = c.get("type") == "PodScheduled" and c.get("status") == "False"
            if unschedulable and c.get("reason") == "Unschedulable" and reason is None:
                reason, message = "Unschedulable", " ".join(str(c.get("message") or "").split())
        statuses = [
            *(status.get("initContainerStatuses") or ()),
            *(status.get("containerStatuses") or ()),
        ]
        for container in statuses:
            found = _container_failure(container)
            if found is not None and reason is None and not ready:
                reason, message = found
        return cls(
            name=str(meta.get("name", "")),
            component=str((meta.get("labels") or {}).get(names.LABEL_ROLE, "")),
            ready=ready,
            failure_reason=reason,
            failure_message=message,
        )

    @property
    def failing(self) -> bool:
        return self.failure_reason is not None

    def describe(self) -> str:
        """``pod NAME: REASON: message`` for a condition message."""
        text = f"pod {self.name}: {self.failure_reason}"
        return f"{text}: {self.failure_message}" if self.failure_message else text


def _last_words(terminated: Mapping[str, Any]) -> str:
    text = " ".join(str(terminated.get("message") or "").split())
    if len(text) > MESSAGE_LIMIT:
        text = "..." + text[-MESSAGE_LIMIT:]
    code = terminated.get("exitCode")
    head = f"exit code {code}" + (f" ({terminated['reason']})" if terminated.get("reason") else "")
    return f"{head}: {text}" if text else head


def _container_failure(container: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when this container is failing, else None."""
    state = container.get("state") or {}
    last = (container.get("lastState") or {}).get("terminated")
    name = container.get("name", "?")
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in FAILING_WAITING_REASONS:
        parts = [f"container {name}"]
        if last:
            parts.append(f"last {_last_words(last)}")
        elif waiting.get("message"):
            parts.append(str(waiting["message"]))
        return str(waiting["reason"]), "; ".join(parts)
    terminated = state.get("terminated")
    if terminated and terminated.get("exitCode", 0) != 0:
        return "ContainerFailed", f"container {name} {_last_words(terminated)}"
    if last and last.get("exitCode", 0) != 0 and not container.get("ready"):
        return "ContainerRestarted", f"container {name} restarted after {_last_words(last)}"
    return None
