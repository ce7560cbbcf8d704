"""The `kvmux` command and the subcommands that belong to no one folder
(chat, doctor): the top floor, free to import every other folder; nothing
imports it (docs: DESIGN "Layout")."""
