from composer.cli.main import main

main()
