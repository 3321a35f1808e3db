"""Engines that use xdc: each integration imports its engine lazily, so installing xdc never
pulls an inference engine in."""
