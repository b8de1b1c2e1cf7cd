from tally_server.cli import main

main()
