"""The parts of the GPT-2 trainer, imported by the root commands (the README's "A short tour")."""
