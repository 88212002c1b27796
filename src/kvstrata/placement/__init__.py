"""Placement: the one planner that decides where KV blocks go, and the executors that run its
plans. Torch-free and thread-free; see :mod:`kvstrata.placement.planner`."""

from .executors import EngineExecutor, ImmediateExecutor, drive
from .onboard import LoadFailure, OnboardResult
from .planner import PlacementError, Planner
from .keys import block_key, parse_block_key
from .telemetry import SKIP_REASONS, PathStats, PlacementListener, PlacementStats

__all__ = ["Planner", "PlacementError", "OnboardResult", "LoadFailure", "PlacementListener",
           "PlacementStats", "PathStats", "SKIP_REASONS", "ImmediateExecutor", "EngineExecutor",
           "drive", "block_key", "parse_block_key"]
