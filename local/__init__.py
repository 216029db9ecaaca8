"""What the client and the supervisor both read on the local machine.

The state directory's file names and key, the lock check, the zmq frame
helpers and the one prctl(2) wrapper. Neither side owns these, so neither
imports the other for them: an embedding front end imports the client and
never loads the supervisor. Importing this package imports nothing else;
each module imports only what it needs (only `frames` imports zmq).
"""
