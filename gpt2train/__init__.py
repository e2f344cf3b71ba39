"""The parts of the GPT-2 trainer: the commands at the repository root import them (see README "Layout")."""
