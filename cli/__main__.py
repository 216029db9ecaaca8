from hermes_sup.cli.main import main

main()
