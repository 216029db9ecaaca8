"""The `hermes-sup` command line: main.py holds the command group and the
client commands, send.py a turn at the terminal, attach.py an attached
terminal, serve.py the supervisor's own command and settings, keys.py
remote front ends' keys, service.py the systemd unit, http.py the HTTP
endpoint's commands; show.py and terminal.py shape the output (a session's
control sequences are shown escaped on a terminal), options.py the options
every client command takes, complete.py shell completion of keys with ':',
logfiles.py session logs read from disk."""
