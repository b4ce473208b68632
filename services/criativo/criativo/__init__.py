"""Criativo: one actor per session, streaming turns, business rules, the brief (ADR 0008)."""
