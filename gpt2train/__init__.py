"""The parts of the GPT-2 trainer, imported by the commands at the root (mapped in the README's "A short tour")."""
