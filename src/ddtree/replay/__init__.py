"""Traces and exact greedy replay: record one greedy pass with the drafter's top-K at every
position, then replay any policy and budget without running a model."""
