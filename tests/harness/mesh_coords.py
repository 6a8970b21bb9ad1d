"""``MeshCoords``: a mesh's sizes and one rank's coordinates, no process groups, so a test can
compute the layout of any rank of any mesh (``layout.py`` reads it as ``mesh.Coords``; a live
mesh gives ``MeshInfo``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshCoords:
    g: int
    m: int
    k: int
    l: int  # noqa: E741

    @property
    def n(self) -> int:
        return self.g * self.m
