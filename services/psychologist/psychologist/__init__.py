"""The Psicólogo: closed sessions analysed into hypotheses that cite real events (ADR 0015)."""
