from kvstore.cli import main

main()
