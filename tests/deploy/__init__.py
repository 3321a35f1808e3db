"""Config loading and the shipped deploy/ files."""
