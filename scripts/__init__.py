"""Repository chores: bootstrap, the demo, generated stubs and the settings table."""
