"""Timing of qcompile's targets and of the engines users would pick instead."""
