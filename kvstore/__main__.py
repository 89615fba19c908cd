from kvstore.cli import main

main(prog_name="kvstore")
