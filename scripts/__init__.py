"""Repository chores: bootstrap, the demo, generated stubs and the README settings table."""
